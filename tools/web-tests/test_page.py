"""The built-in page at `/` in headless Chromium, against a running `moeshard serve`.

Loads the page, checks that the cluster view renders the server's status (topology, nodes,
figures), sends a chat message and checks that the streamed reply rendered in the page is
exactly the text the API gives for the same request without streaming, and that the cluster
view then counts the generated tokens. With MOESHARD_SCREENSHOT_DIR set, saves the window
there as web.png.

Environment: MOESHARD_SERVER_URL, MOESHARD_BROWSER (chromium binary), MOESHARD_CHROMEDRIVER.
"""

import json
import os
import sys
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

URL = os.environ["MOESHARD_SERVER_URL"].rstrip("/")
# Upper bounds for waits, not expectations: CI machines are slow and shared.
WAIT_S = 120
PROMPT = "ROMEO:"
MAX_TOKENS = 24


def api_reply(prompt):
    """The non-streamed reply of the API to the request the page sends (greedy)."""
    body = json.dumps({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }).encode()
    req = urllib.request.Request(URL + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = os.environ["MOESHARD_BROWSER"]
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,860", "--no-first-run", "--disable-extensions"]:
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(os.environ["MOESHARD_CHROMEDRIVER"]), options=opts)


def text_of(d, css):
    """The rendered text of the element `css` selects, read in one script call: the cluster
    view re-renders every second, so an element found in one call may be gone in the next."""
    text = d.execute_script("const e = document.querySelector(arguments[0]); return e && e.innerText;", css)
    assert text is not None, f"nothing matches {css}"
    return text.strip()


def tile(d, label):
    return text_of(d, f'.tile[data-label="{label}"] .value')


def main():
    d = browser()
    try:
        run(d)
    except Exception:
        for entry in d.get_log("browser"):
            print("browser console:", entry, file=sys.stderr)
        raise
    finally:
        d.quit()


def run(d):
    wait = WebDriverWait(d, WAIT_S, ignored_exceptions=[StaleElementReferenceException])
    d.get(URL + "/")
    assert d.title == "moeshard", d.title

    # The cluster view: filled from /v1/status.
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-status") == "loaded")
    status = json.load(urllib.request.urlopen(URL + "/v1/status", timeout=WAIT_S))
    assert text_of(d, "#cluster-kind") == status["cluster"]["kind"].replace("_", " "), text_of(d, "#cluster-kind")
    assert text_of(d, "#cluster-complete") == "complete"
    assert text_of(d, "#conn") == "connected"
    rows = d.execute_script(
        "return [...document.querySelectorAll('#nodes tbody tr')]"
        ".map((r) => [...r.cells].map((c) => c.innerText.trim()));")
    assert len(rows) == len(status["cluster"]["nodes"]), rows
    first = rows[0]
    node = status["cluster"]["nodes"][0]
    assert first[0] == node["role"] and first[1] == node["layers"], first
    assert status["model"]["id"] in text_of(d, "#model-name")
    assert tile(d, "slots busy").endswith("/ " + str(int(status["server"]["slots"]))), tile(d, "slots busy")
    for label in ["decode tokens/s", "prompt tokens/s", "queue depth", "KV cache in use"]:
        tile(d, label)
    generated_before = int(tile(d, "tokens generated"))

    # The chat: a greedy reply, streamed into the page.
    d.find_element(By.ID, "temperature").clear()
    d.find_element(By.ID, "temperature").send_keys("0")
    d.find_element(By.ID, "max-tokens").clear()
    d.find_element(By.ID, "max-tokens").send_keys(str(MAX_TOKENS))
    d.find_element(By.ID, "input").send_keys(PROMPT)
    d.find_element(By.ID, "send").click()
    done = '.msg.assistant[data-state="done"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, done))
    assert d.find_element(By.ID, "chat-error").get_attribute("hidden") is not None, text_of(d, "#chat-error")
    user = d.find_elements(By.CSS_SELECTOR, ".msg.user .content")
    assert [u.text for u in user] == [PROMPT], [u.text for u in user]
    shown = d.find_element(By.CSS_SELECTOR, done + " .content").get_attribute("textContent")
    assert shown.strip(), "the reply is empty"
    expected = api_reply(PROMPT)
    assert shown == expected, f"page shows {shown!r}, the API replies {expected!r}"
    note = text_of(d, done + " .usage")
    assert "generated" in note and "finish:" in note, note
    # No reasoning deltas from this model: the reasoning block stays hidden.
    assert not d.find_element(By.CSS_SELECTOR, done + " details.reasoning").is_displayed()

    # The cluster view catches up with the tokens just generated.
    wait.until(lambda d: int(tile(d, "tokens generated")) >= generated_before + 2)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.tile[data-label="mean time to first token"]'))

    shots = os.environ.get("MOESHARD_SCREENSHOT_DIR")
    if shots:
        os.makedirs(shots, exist_ok=True)
        d.save_screenshot(os.path.join(shots, "web.png"))
    print(f"web page OK: reply {shown!r}; cluster view {status['cluster']['kind']}")


if __name__ == "__main__":
    main()
