"""Drive Debian's headless Chromium (through Playwright's protocol driver, no browser download) over the
Prefect UI's flow run page, and save what a person would see."""

from __future__ import annotations

import tempfile
from pathlib import Path

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def settle(page) -> None:
    """Let route transitions finish fading in before a screenshot."""
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(1500)


def capture_flow_run(ui_url: str, flow_run_id: str, run_id: str, chromium: str, out: Path) -> dict:
    """Open the flow run's Artifacts tab, then the evaluation table and the loss image; screenshot each."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        browser = p.chromium.launch_persistent_context(
            profile, executable_path=chromium, args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1600}
        )
        page = browser.new_page()
        page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
        page.get_by_text("Artifacts", exact=True).first.click()
        page.get_by_text(f"evaluation-{run_id}").first.wait_for(timeout=30_000)
        settle(page)
        page.screenshot(path=str(out / "flow-run-artifacts.png"), full_page=True)
        cards = page.inner_text("body")

        page.get_by_text(f"evaluation-{run_id}").first.click()
        page.get_by_text("exact_match").first.wait_for(timeout=30_000)
        settle(page)
        page.screenshot(path=str(out / "evaluation.png"), full_page=True)
        evaluation_text = page.inner_text("body")

        page.go_back(wait_until="networkidle")
        page.get_by_text("Artifacts", exact=True).first.click()
        page.get_by_text(f"loss-curve-{run_id}").first.click()
        image = page.locator("img[src^='data:image/png']").first
        image.wait_for(timeout=30_000)
        settle(page)
        page.screenshot(path=str(out / "loss-curve.png"), full_page=True)
        width = image.evaluate("img => img.naturalWidth")
        browser.close()
    return {"cards": cards, "evaluation_text": evaluation_text, "loss_image_width": width}
