"""The playground against a server whose engine replies with fixed text (markup included): the reply
streams into the page as text, never as HTML; an error answer is shown; the conversation survives a
reload. The same pages against the real engine are in test_playground_live.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import types
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from llmserve.config import CacheConfig
from llmserve.entrypoints.openai.api_server import build_app
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams
from tests.entrypoints.test_server_units import FailingEngine
from tests.helpers import wait_until
from tests.web.browser import console_errors, horizontal_overflow, screenshot

pytestmark = pytest.mark.browser

REPLY = "<script>window.__injected = 1</script><b>not bold</b> <img src=x onerror=window.__injected=2> done"


class _ChatTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def chat_template_text(self, override: str | None = None, tools: bool = False) -> str:
        return override or "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

    def render_chat(self, messages, *_template_args, **_template_kwargs) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class ScriptedEngine(FailingEngine):
    """Replies REPLY, a few characters per step, whatever the prompt."""

    def __init__(self) -> None:
        super().__init__(fail_after=None)
        self.tokenizer = _ChatTokenizer()
        cache = CacheConfig(
            block_size=16, num_blocks=64, kv_cache_memory=1 << 20
        )  # every field /server_info reads
        self.config = types.SimpleNamespace(**vars(self.config), cache=cache)
        self.config.model.max_model_len = 4096

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator:
        pieces = [REPLY[i : i + 7] for i in range(0, len(REPLY), 7)]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0.02)  # a reply that streams over time, as the page must show it
            done = i == len(pieces) - 1
            ids = list(piece.encode())
            completion = CompletionOutput(0, piece, ids, "stop" if done else None)
            yield RequestOutput(request_id, None, list(prompt), [completion], finished=done)


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = build_app(ScriptedEngine(), "scripted-model")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the scripted server")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    with contextlib.suppress(Exception):
        thread.join(10)


def send(page, text: str) -> None:
    box = page.find_element(By.ID, "chat-input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)  # the keyboard path: Enter sends


def last_reply(page):
    return page.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def test_a_reply_with_markup_is_rendered_as_text(page, scripted_url):
    page.get(scripted_url + "/")
    wait_until(
        lambda: "scripted-model" in page.find_element(By.ID, "model-info").text, 30, "the model's name"
    )
    send(page, "show me some HTML")
    wait_until(
        lambda: "stats" and "TTFT" in last_reply(page).find_element(By.CLASS_NAME, "stats").text,
        30,
        "the reply",
    )
    content = last_reply(page).find_element(By.CLASS_NAME, "content")
    assert content.text == REPLY  # every character shown as typed
    assert content.find_elements(By.XPATH, ".//*") == []  # no element was made from the reply
    assert page.execute_script("return window.__injected === undefined")
    assert console_errors(page) == []
    assert horizontal_overflow(page) <= 0
    screenshot(page, "playground-markup-reply")


def test_the_conversation_survives_a_reload(page, scripted_url):
    page.get(scripted_url + "/")
    send(page, "remember me")
    wait_until(lambda: "TTFT" in last_reply(page).find_element(By.CLASS_NAME, "stats").text, 30, "the reply")
    page.refresh()
    messages = wait_until(lambda: page.find_elements(By.CSS_SELECTOR, ".message"), 10, "the stored messages")
    assert [m.find_element(By.CLASS_NAME, "content").text for m in messages] == ["remember me", REPLY]
    assert console_errors(page) == []


def test_an_error_answer_is_shown_in_the_reply(page, scripted_url):
    page.get(scripted_url + "/")
    page.find_element(By.ID, "temperature").clear()
    page.find_element(By.ID, "temperature").send_keys("-3")  # the server answers 400
    send(page, "hello")
    error = wait_until(
        lambda: page.find_elements(By.CSS_SELECTOR, ".message.assistant .content.error"), 30, "error"
    )
    assert "HTTP 400" in error[0].text and "temperature" in error[0].text
    screenshot(page, "playground-error")


def test_completions_tab_streams_a_completion(page, scripted_url):
    page.get(scripted_url + "/")
    page.find_element(By.ID, "tab-completions").click()
    prompt = page.find_element(By.ID, "prompt")
    prompt.send_keys("Once upon a time")
    prompt.send_keys(Keys.CONTROL, Keys.ENTER)
    wait_until(lambda: "TTFT" in page.find_element(By.ID, "completion-stats").text, 30, "the completion")
    assert page.find_element(By.ID, "completion-output").text == REPLY
    assert console_errors(page) == []
    assert horizontal_overflow(page) <= 0
    screenshot(page, "playground-completions")


RECORD_BODIES = """
window.__bodies = [];
const original = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.__bodies.push(JSON.parse(init.body));
  return original(url, init);
};
"""


def test_a_schema_that_is_not_json_is_an_error_before_sending(page, scripted_url):
    page.get(scripted_url + "/")
    page.execute_script(RECORD_BODIES)
    page.find_element(By.ID, "json-schema").send_keys("{not json")
    send(page, "hello")
    error = wait_until(
        lambda: page.find_elements(By.CSS_SELECTOR, ".message.assistant .content.error"), 10, "error"
    )
    assert "JSON" in error[0].text
    assert page.execute_script("return window.__bodies") == []
