"""Headless Chromium from the system's packages, driven by Selenium: no browser is downloaded.

A missing browser or driver fails the test with one line saying how to install them (never a skip).
Screenshots go to test-artifacts/web/ (ignored by git) for a person to look at.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = "/usr/bin/chromedriver"
INSTALL = "headless Chromium is missing: run `apt-get install -y chromium chromium-driver` (.ci/run does)"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
PHONE = (390, 844)


def start_browser():
    """A headless Chromium at a 390x844 phone viewport, logging the console."""
    binary = next((path for path in CHROMIUM if os.path.exists(path)), None)
    if binary is None or not os.path.exists(DRIVER):
        pytest.fail(INSTALL, pytrace=False)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={PHONE[0]},{PHONE[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": PHONE[0], "height": PHONE[1], "deviceScaleFactor": 1, "mobile": True},
    )
    driver.set_script_timeout(30)
    return driver


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def horizontal_overflow(driver) -> int:
    """Pixels the page is wider than the viewport (0: no horizontal scrolling)."""
    return driver.execute_script(
        "return Math.max(document.documentElement.scrollWidth, document.body.scrollWidth) - window.innerWidth"
    )


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path
