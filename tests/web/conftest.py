from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.web.browser import start_browser


@pytest.fixture(scope="module")
def browser() -> Iterator:
    driver = start_browser()
    yield driver
    driver.quit()


@pytest.fixture
def page(browser):
    """The browser with a clean slate: no stored conversation, key or settings, an empty console."""
    yield browser
    browser.execute_script("window.localStorage.clear()")
    browser.get_log("browser")


from tests.entrypoints.conftest import server, tiny_model_dir  # noqa: E402, F401 - the real server's fixtures
