"""The server's check of a request's grammar before it starts: compiled in the GrammarCompiler's
threads (the event loop keeps serving), within the configured budget. An invalid or unsupported
grammar, or one over budget, is a 400 naming the field that asked for it; a grammar that passed is
in the server's cache, so the same schema next time costs nothing."""

from __future__ import annotations

import asyncio

from llmserve.entrypoints.openai.protocol import _SamplingRequest
from llmserve.entrypoints.openai.serving import ApiError, ServerContext
from llmserve.sampling_params import SamplingParams
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.params import GrammarError


async def check_structured_outputs(
    ctx: ServerContext, request: _SamplingRequest, params: SamplingParams
) -> None:
    spec = params.structured_outputs
    if spec is None:
        return
    compiler = _compiler(ctx)
    timeout = ctx.engine.config.structured_outputs.compile_timeout
    param = request.structured_outputs_field()
    try:
        # shielded: a timed-out compile finishes in its thread and stays cached for the next request
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiler.submit(spec))), timeout)
    except TimeoutError as error:
        raise ApiError(
            f"{param}: the grammar did not compile within {timeout:g} s (the server's "
            "--structured-outputs-compile-timeout); simplify the schema",
            param=param,
        ) from error
    except GrammarError as error:
        raise ApiError(f"{param}: {error}", param=param) from error


def prepare_grammars(ctx: ServerContext) -> None:
    """Start building the server's vocabulary table in the background (the first structured request
    waits only for what is left of it)."""
    _compiler(ctx).prepare()


def _compiler(ctx: ServerContext) -> GrammarCompiler:
    if ctx.grammar_compiler is None:
        engine = ctx.engine
        arch = engine.config.model.arch
        eos = tuple(engine.tokenizer.eos_token_ids) or arch.eos_token_ids
        ctx.grammar_compiler = GrammarCompiler(engine.tokenizer, arch.vocab_size, eos)
    return ctx.grammar_compiler
