import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from tqdm.std import tqdm

from fixtures import fixture_dir

# No tqdm monitor thread in the test process: the one thread alive at interpreter exit after a full run (a daemon
# that wakes every 10 s), where one of two fresh-clone runs of the suite died with a segmentation fault after its
# summary (session 24). Progress bars are unchanged; only tqdm's check for stalled bars goes.
tqdm.monitor_interval = 0


def golden_dir() -> Path:
    return fixture_dir("pi05_golden")


@pytest.fixture(scope="session")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="session")
def golden_policy(golden):
    from vlaserve import Policy

    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes long on 2 CPU cores (servers, Ray, the Triton interpreter)")


# ---- a real browser, and the demo server it opens ------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, which .ci/run installs), driven by Playwright: the pages as a person
    sees them (/docs, the page at /). Playwright's own browser download is not used. One per test module:
    Playwright's sync API holds an event loop on this thread while it runs, where the later modules'
    asyncio.run() would fail."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed (`apt-get install chromium`, which .ci/run does): "
                    "the browser tests need it")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium)
        yield launched
        launched.close()


@pytest.fixture()
def page(browser):
    """A fresh tab of the shared browser. Its waits and `expect`s are long (2 minutes): a busy 2-core
    machine runs the demo's first request and Swagger UI's start-up slowly, and a wait ends as soon as
    its state shows."""
    tab = browser.new_page(viewport={"width": 1280, "height": 900})
    tab.set_default_timeout(120_000)
    expect.set_options(timeout=120_000)
    yield tab
    tab.close()


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`vlaserve serve` with no checkpoint (the demo) on the CPU, as the README's first command runs it."""
    from test_server import ServerProcess

    tmp = tmp_path_factory.mktemp("demo_server")
    proc = ServerProcess(["--device", "cpu", "--dtype", "float32"], tmp / "server.log",
                         env={"VLASERVE_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1"})
    proc.cache = tmp / "cache"  # the demo checkpoint, built once: other demo servers of the session share it
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()
