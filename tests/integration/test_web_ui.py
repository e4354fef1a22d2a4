"""The web pages in a real browser: headless Chromium driven through selenium against one server with
two models (a text model and a vision-language one) behind an API key. The chat page asks for the key
and shows the 401 without it, streams an answer token by token, stops an answer and the server aborts
it, keeps the conversation over a reload, shows model text as text (a stored answer holding a script
and an onerror image runs neither), sends an image to the vision model chosen in the picker, and fits
a phone-width screen; the status page shows /metrics' own numbers within one refresh while a load
runs. Each step leaves a screenshot in $CRANE_MP_TEST_ARTIFACTS (else the test's temporary directory).

The browser and its driver come from the system (.ci/run installs Debian's `chromium` and
`chromium-driver`); without them the tests skip and say so."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from crane_mp.testing.make_model import make_model
from crane_mp.testing.make_vl import make_vl
from tests.integration.server import Server

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no Chromium and chromedriver on this machine (.ci/run installs Debian's)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    text, vision = make_model("qwen3", "tiny", root / "text", seed=4), make_vl(root / "vision")
    srv = Server(None, "--model-path", f"text={text}", "--model-path", f"vision={vision}", "--api-key", KEY,
                 log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("CRANE_MP_TEST_ARTIFACTS") or tmp_path_factory.mktemp("screenshots")) / "web_ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser(server, artifacts):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def shot(browser, artifacts: Path, name: str) -> None:
    browser.save_screenshot(str(artifacts / f"{name}.png"))


def wait_for(predicate, timeout: float = 120, what: str = "the page"):
    """Poll a condition the page reaches on its own (a streamed answer, a refresh): the bound is only
    there so that a broken page fails instead of hanging."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(name: str, server: Server, **labels: str) -> float:
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settings(browser, **values: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "open-settings").click()
    for field, value in values.items():
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.CSS_SELECTOR, "#settings button[type=submit]").click()


def pick(browser, model: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def listed() -> list[str]:
        return [option.get_attribute("value") for option in browser.find_elements(By.CSS_SELECTOR, "#model option")]

    wait_for(lambda: model in listed(), what=f"{model} in the model picker")
    Select(browser.find_element(By.ID, "model")).select_by_value(model)


def answers(browser) -> list:
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")


def finished_stats(browser) -> str:
    """The newest answer's footer once it finished (its token counts, speed, or "stopped"). Read in one
    script: the page redraws an answer as it streams, which would leave a handle found before stale."""
    return browser.execute_script("""
        const answers = document.querySelectorAll('.message.assistant');
        const stats = answers.length ? answers[answers.length - 1].querySelector('.stats') : null;
        return stats ? stats.textContent : '';""")


def send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_without_the_key_the_page_shows_the_401(server, browser, artifacts):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    notice = wait_for(lambda: browser.find_element(By.ID, "notice").text, what="the 401 notice")
    assert "401" in notice and "API key" in notice
    settings(browser, **{"api-key": "wrong"})
    wait_for(lambda: "401" in browser.find_element(By.ID, "notice").text, what="the 401 notice for a wrong key")
    # The key lives in this tab's session storage only.
    assert browser.execute_script("return sessionStorage.getItem('crane-mp-api-key')") == "wrong"
    assert "wrong" not in browser.execute_script("return JSON.stringify(Object.assign({}, localStorage))")
    shot(browser, artifacts, "01-wrong-key")
    settings(browser, **{"api-key": KEY, "max-tokens": "48", "temperature": "0"})
    pick(browser, "text")
    wait_for(lambda: not browser.find_element(By.ID, "notice").is_displayed(), what="the notice to go")


def answer_text(browser) -> str:
    """The newest answer's text so far, its reasoning included (read in one script, as finished_stats)."""
    return browser.execute_script("""
        const answers = document.querySelectorAll('.message.assistant');
        if (!answers.length) return '';
        const answer = answers[answers.length - 1], thought = answer.querySelector('.thought');
        return (thought ? thought.textContent : '') + answer.querySelector('.content').textContent;""")


def test_an_answer_finishes_with_its_counts(server, browser, artifacts):
    before = metric("vllm:generation_tokens_total", server, model_name="text")
    send(browser, "Tell me a story")
    stats = wait_for(lambda: finished_stats(browser), what="the answer to finish")
    shot(browser, artifacts, "02-finished")
    assert re.search(r"\d+ prompt \+ 48 tokens", stats) and "tok/s" in stats, stats
    assert metric("vllm:generation_tokens_total", server, model_name="text") == before + 48


def test_a_streaming_answer_shows_as_it_comes_and_stop_aborts_it_on_the_server(server, browser, artifacts):
    from selenium.webdriver.common.by import By

    aborted = metric("vllm:request_success_total", server, model_name="text", finished_reason="abort")
    worker = int(re.search(r"launch\[text\]: started worker process pid=(\d+)", server.log_path.read_text()).group(1))
    settings(browser, **{"max-tokens": "1500"})
    send(browser, "Go on for a long time")
    # The first tokens on the page, then the text model's worker frozen: 1,500 tokens are far from written
    # when the first show, whatever the machine's speed, so the page holds part of an answer, no footer,
    # while the server still runs the request, and the answer is still running when Stop is pressed.
    wait_for(lambda: answer_text(browser), what="the first tokens on the page")
    psutil.Process(worker).suspend()
    try:
        assert answer_text(browser) and not finished_stats(browser)
        assert browser.find_element(By.ID, "stop").is_displayed()
        assert metric("vllm:num_requests_running", server, model_name="text") == 1
        shot(browser, artifacts, "02-streaming")
        browser.find_element(By.ID, "stop").click()
        stats = wait_for(lambda: finished_stats(browser), what="the stopped answer")
    finally:
        psutil.Process(worker).resume()
    assert "stopped" in stats
    wait_for(lambda: metric("vllm:request_success_total", server, model_name="text", finished_reason="abort")
             == aborted + 1, what="the server to count the abort")
    shot(browser, artifacts, "03-stopped")
    settings(browser, **{"max-tokens": "48"})


def test_regenerate_edit_and_a_text_file_as_context(server, browser, artifacts, tmp_path):
    from selenium.webdriver.common.by import By

    finished = metric("vllm:request_success_total", server, model_name="text")
    answers(browser)[-1].find_element(By.CSS_SELECTOR, ".regenerate").click()  # the stopped answer, again
    stats = wait_for(lambda: finished_stats(browser) if "stopped" not in finished_stats(browser) else "",
                     what="the regenerated answer")
    assert "48 tokens" in stats and len(answers(browser)) == 2
    plain = int(re.search(r"(\d+) prompt", stats).group(1))
    # Edit the last question: it and its answer go, its text comes back into the box, and the resent one
    # carries a text file as context (more prompt tokens than the question alone).
    browser.find_elements(By.CSS_SELECTOR, ".message.user .edit")[-1].click()
    box = browser.find_element(By.ID, "prompt")
    assert box.get_attribute("value") == "Go on for a long time" and len(answers(browser)) == 1
    notes = tmp_path / "notes.txt"
    notes.write_text("The context: " + "alpha beta gamma " * 20)
    browser.find_element(By.ID, "attach").send_keys(str(notes))
    wait_for(lambda: "notes.txt" in browser.find_element(By.ID, "attachments").text, what="the attachment chip")
    browser.find_element(By.ID, "send").click()
    stats = wait_for(lambda: finished_stats(browser) if len(answers(browser)) == 2 else "", what="the resent answer")
    assert int(re.search(r"(\d+) prompt", stats).group(1)) > plain + 40
    assert "notes.txt" in browser.find_elements(By.CSS_SELECTOR, ".message.user")[-1].text
    assert metric("vllm:request_success_total", server, model_name="text") == finished + 2
    shot(browser, artifacts, "04-edited-with-file")


def test_the_conversation_survives_a_reload(server, browser, artifacts):
    from selenium.webdriver.common.by import By

    texts = [node.text for node in browser.find_elements(By.CSS_SELECTOR, ".message.user .content")]
    browser.refresh()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message"), what="the stored conversation")
    assert [node.text for node in browser.find_elements(By.CSS_SELECTOR, ".message.user .content")] == texts
    assert "Tell me a story" in browser.find_element(By.ID, "conversation-list").text
    shot(browser, artifacts, "05-reloaded")


def test_model_text_is_shown_as_text_never_run(server, browser, artifacts):
    from selenium.webdriver.common.by import By

    hostile = ('<script>window.ranHostile = 1</script><img src=x onerror="window.ranHostile = 2"> **bold** '
               '[link](javascript:window.ranHostile=3) `<b>code</b>`')
    browser.execute_script("""
        const conversations = JSON.parse(localStorage.getItem('crane-mp-conversations') || '[]');
        conversations.unshift({id: 'hostile', title: 'hostile', created: '', messages: [
          {role: 'user', content: arguments[0]},
          {role: 'assistant', content: arguments[0], reasoning: arguments[0]}]});
        localStorage.setItem('crane-mp-conversations', JSON.stringify(conversations));
    """, hostile)
    browser.refresh()
    answer = wait_for(lambda: answers(browser), what="the stored answer")[-1]
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    assert "<script>window.ranHostile = 1</script>" in content.text
    assert '<img src=x onerror="window.ranHostile = 2">' in content.text
    assert content.find_elements(By.TAG_NAME, "strong") and not content.find_elements(By.TAG_NAME, "img")
    assert not content.find_elements(By.TAG_NAME, "script") and not content.find_elements(By.TAG_NAME, "a")
    assert content.find_element(By.TAG_NAME, "code").text == "<b>code</b>"
    assert browser.execute_script("return window.ranHostile") is None
    shot(browser, artifacts, "06-hostile-text")
    browser.find_element(By.ID, "new-chat").click()


def test_an_image_goes_to_the_vision_model_picked(server, browser, artifacts, tmp_path):
    from PIL import Image
    from selenium.webdriver.common.by import By

    image = tmp_path / "square.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(image)
    images = metric("crane:request_images_count", server, model_name="vision")
    pick(browser, "vision")
    browser.find_element(By.ID, "attach").send_keys(str(image))
    wait_for(lambda: "square.png" in browser.find_element(By.ID, "attachments").text, what="the attachment chip")
    send(browser, "What colour is this?")
    stats = wait_for(lambda: finished_stats(browser), what="the vision model's answer")
    assert "tokens" in stats and not answers(browser)[-1].find_elements(By.CSS_SELECTOR, ".error"), stats
    assert browser.find_elements(By.CSS_SELECTOR, ".message.user img.thumb")
    assert metric("crane:request_images_count", server, model_name="vision") == images + 1
    shot(browser, artifacts, "07-image")
    pick(browser, "text")


def test_the_page_fits_a_phone_screen(server, browser, artifacts):
    browser.set_window_size(390, 844)
    try:
        browser.refresh()
        wait_for(lambda: browser.execute_script("return document.readyState") == "complete")
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        shot(browser, artifacts, "08-phone")
    finally:
        browser.set_window_size(1200, 900)


def test_the_status_page_shows_the_servers_numbers_while_a_load_runs(server, browser, artifacts):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/status")

    def shown() -> dict[str, str]:  # one script: the page redraws its cards every second
        return browser.execute_script("""
            for (const card of document.querySelectorAll('.model-card')) {
              if (card.querySelector('h2').textContent !== 'text') continue;
              const values = [...card.querySelectorAll('dd')].map((dd) => [dd.dataset.metric, dd.textContent]);
              return Object.fromEntries(values);
            }
            return {};""")

    def refreshed_after(moment: str) -> None:
        wait_for(lambda: browser.find_element(By.ID, "updated").text not in ("", moment), what="a refresh")

    wait_for(shown, what="the text model's card")
    finished = lambda: metric("vllm:request_success_total", server, model_name="text")  # noqa: E731
    generated = lambda: metric("vllm:generation_tokens_total", server, model_name="text")  # noqa: E731

    checked = threading.Event()
    sent = []

    def load() -> None:  # requests one after another until the checks are done (a hundred at most)
        body = {"model": "text", "prompt": "count", "max_tokens": 64, "ignore_eos": True}
        while not checked.is_set() and len(sent) < 100:
            sent.append(requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=300).ok)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_for(lambda: sent, what="the load to start")
        for _ in range(3):  # while the load runs: the page's totals lie between two readings of /metrics
            low = (finished(), generated())
            refreshed_after(browser.find_element(By.ID, "updated").text)
            page = shown()
            high = (finished(), generated())
            assert low[0] <= float(page["finished"]) <= high[0], (low, page, high)
            assert low[1] <= float(page["generation-tokens"]) <= high[1], (low, page, high)
    finally:
        checked.set()
        loader.join()
    assert all(sent)
    shot(browser, artifacts, "09-status-under-load")
    refreshed_after(browser.find_element(By.ID, "updated").text)
    refreshed_after(browser.find_element(By.ID, "updated").text)
    page = shown()  # at rest: exactly /metrics' numbers
    assert float(page["finished"]) == finished() and float(page["generation-tokens"]) == generated()
    assert page["running"] == "0" and page["waiting"] == "0"
    assert float(page["prompt-tokens"]) == metric("vllm:prompt_tokens_total", server, model_name="text")
    assert "ms" in page["ttft"] or " s" in page["ttft"]
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not severe, severe  # no script error, no policy violation
