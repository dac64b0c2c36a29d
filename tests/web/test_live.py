"""The playground and the dashboard against a real server (the tiny model, behind an API key): a chat
streams into the page, Stop aborts the request in the engine and frees its KV, the dashboard shows
the traffic; no console errors and no horizontal scrolling at a phone's width."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_server_lifecycle import MODEL, delta, wait_idle
from tests.helpers import wait_until
from tests.web.browser import console_errors, horizontal_overflow, screenshot
from tests.web.test_playground_scripted import RECORD_BODIES

pytestmark = [pytest.mark.browser, pytest.mark.server]

ABORTED = "llmserve:request_success_total{finished_reason=abort}"


def open_playground(page, server, max_tokens: int) -> None:
    page.get(server.base_url + "/")
    key = wait_until(
        lambda: page.find_element(By.ID, "api-key").is_displayed() and page.find_element(By.ID, "api-key"),
        30,
        "the key box",
    )
    key.send_keys(API_KEY, Keys.TAB)  # `change` fires: the page reads /v1/models with it
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        page.find_element(By.ID, field).clear()
        page.find_element(By.ID, field).send_keys(value)


def last_reply(page):
    return page.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


ANSWER_SCHEMA = json.dumps(
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
)


def test_the_json_schema_box_constrains_the_reply(page, server):
    """The box sends response_format json_schema; the reply is a document valid against the schema."""
    open_playground(page, server, max_tokens=40)
    page.execute_script(RECORD_BODIES)
    page.find_element(By.ID, "json-schema").send_keys(ANSWER_SCHEMA)
    page.find_element(By.ID, "chat-input").send_keys("Answer in JSON", Keys.ENTER)
    wait_until(lambda: "TTFT" in last_reply(page).text, 120, "the reply")
    body = page.execute_script("return window.__bodies")[-1]
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "playground", "schema": json.loads(ANSWER_SCHEMA), "strict": True},
    }
    reply = last_reply(page).find_element(By.CLASS_NAME, "content")
    assert "error" not in reply.get_attribute("class"), reply.text
    assert json.loads(reply.text)["answer"] in ("yes", "no")
    assert console_errors(page) == []
    screenshot(page, "playground-json-schema")


def test_a_chat_streams_into_the_page(page, server):
    open_playground(page, server, max_tokens=24)
    page.find_element(By.ID, "system-prompt").send_keys("You are terse.")
    box = page.find_element(By.ID, "chat-input")
    box.send_keys("Say something", Keys.ENTER)
    stats = wait_until(
        lambda: re.search(r"TTFT \d+ ms", last_reply(page).text) and last_reply(page), 120, "a reply"
    )
    assert last_reply(page).find_element(By.CLASS_NAME, "content").text.strip()
    assert re.search(r"TTFT \d+ ms · ([\d.]+ tokens/s · )?\d+ tokens · finish: (length|stop)", stats.text), (
        stats.text
    )
    assert (
        MODEL in page.find_element(By.ID, "model-info").text
        and "1024 tokens" in page.find_element(By.ID, "model-info").text
    )
    assert console_errors(page) == []
    assert horizontal_overflow(page) <= 0
    screenshot(page, "playground-live-chat")


def test_stop_aborts_the_request_in_the_engine(page, server):
    stats = lambda: last_reply(page).find_element(By.CLASS_NAME, "stats").text  # noqa: E731
    for _ in range(3):  # a fast machine can stream all 900 tokens before the click lands: a fresh chat again
        before = wait_idle(server)
        open_playground(page, server, max_tokens=900)  # with the prompt, within the 1024-token context
        page.find_element(By.ID, "chat-input").send_keys("Tell me everything", Keys.ENTER)
        wait_until(
            lambda: last_reply(page).find_element(By.CLASS_NAME, "content").text.strip(), 120, "streamed text"
        )
        stop = page.find_element(By.ID, "stop")
        # the click event itself: a pointer click can land on text the stream is still moving under it
        page.execute_script("arguments[0].click()", stop)
        wait_until(
            lambda: re.fullmatch(r"TTFT \d+ ms · stopped", stats()) or "finish:" in stats(),
            30,
            lambda: f"the reply marked stopped or finished, not {stats()!r}",
        )
        if "finish:" not in stats():
            break
    assert re.fullmatch(r"TTFT \d+ ms · stopped", stats()), f"every reply ended before its stop: {stats()!r}"
    after = wait_idle(server)  # nothing running or waiting, no KV block held
    assert delta(after, before, ABORTED) == 1  # the engine saw the abort
    assert delta(after, before, "llmserve:generation_tokens_total") < 900
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    assert console_errors(page) == []
    screenshot(page, "playground-live-stopped")


def test_the_dashboard_shows_the_traffic(page, server):
    page.get(server.base_url + "/dashboard")
    wait_until(lambda: MODEL in page.find_element(By.ID, "model-info").text, 30, "the first stats")
    body = {"model": MODEL, "prompt": "Count to a hundred", "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    traffic = threading.Thread(
        target=lambda: httpx.post(
            f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=120
        )
    )
    traffic.start()
    legend = lambda: page.find_element(By.ID, "latest-generation_tokens_per_second").text  # noqa: E731
    wait_until(lambda: float(legend().split(": ")[1].replace("–", "0")) > 0, 60, "a generation rate")
    traffic.join()
    tiles = {key: page.find_element(By.ID, f"tile-{key}").text for key in ("total_requests", "total_tokens")}
    wait_until(
        lambda: int(page.find_element(By.ID, "tile-total_requests").text) > 0, 10, "a finished request"
    )
    assert int(page.find_element(By.ID, "tile-total_tokens").text) > 0, tiles
    assert console_errors(page) == []
    assert horizontal_overflow(page) <= 0
    screenshot(page, "dashboard-live")
    page.set_window_size(1280, 900)
    page.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    wait_until(lambda: page.find_element(By.ID, "tile-total_requests").text != "–", 5, "a redraw")
    screenshot(page, "dashboard-live-wide")
