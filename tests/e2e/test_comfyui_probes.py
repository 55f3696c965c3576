"""Re-run of issue 43's adversarial probe families on a real ComfyUI (CPU, tiny models): paths, damaged files, inputs,
faults, load and concurrency, routes. The probes are data (tests/e2e/probes.py); this module starts ONE server (again
only if a probe leaves it unable to run prompts, and that probe fails) and sends each probe, bounded in time.

A probe holds when the user gets a clear answer (a refusal whose message carries no raw Python exception, or a
success where one is expected), no file is overwritten, and the server still runs the next valid prompt. The counts
per family are printed (held / failed), and the test fails listing every probe that did not hold.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))

import probes as P  # noqa: E402
from comfy_server import prepare_base, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

PROMPT_TIMEOUT = 60.0  # seconds a probe's prompt may take on the CPU before it counts as hung


def _raw(text: str) -> str | None:
    return next((marker for marker in P.RAW_MARKERS if marker in text), None)


class Harness:
    def __init__(self, install, base):
        self.install, self.base = install, base
        self.server = start_server(install, base, "--cache-none")
        self.results: dict[str, list[tuple[str, str | None]]] = defaultdict(list)

    def restart(self) -> None:
        self.server.stop()
        self.server = start_server(self.install, self.base, "--cache-none")

    def alive(self) -> str | None:
        """None when the server runs a valid prompt now, else why not."""
        try:
            entry = self.server.wait(self.server.queue_ok(P.good(seed=1)), PROMPT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a dead or hung server is what is measured
            return f"the next valid prompt did not run ({type(exc).__name__})"
        if entry["status"]["status_str"] != "success":
            return "the next valid prompt failed: " + _message(entry)
        return None

    def record(self, probe_family: str, name: str, failure: str | None, check_alive: bool = True) -> None:
        if failure is None and check_alive:
            failure = self.alive()
        if failure is not None and self.server.process.poll() is not None or failure and "did not run" in failure:
            self.restart()
        self.results[probe_family].append((name, failure))

    # -- prompt probes ---------------------------------------------------------------------------------------------

    def outputs(self) -> dict[Path, bytes]:
        root = self.base / "output"
        return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}

    def run_prompt(self, prompt: dict) -> tuple[str, str]:
        """('validation' | 'error' | 'success' | 'hung', the message shown)."""
        response = self.server.queue(prompt)
        if response.status_code != 200:
            return "validation", response.text
        try:
            entry = self.server.wait(response.json()["prompt_id"], PROMPT_TIMEOUT)
        except TimeoutError:
            return "hung", "no answer within the time limit"
        if entry["status"]["status_str"] == "success":
            return "success", ""
        return "error", _message(entry)

    def prompt_probe(self, probe: P.Probe) -> str | None:
        try:
            prompt = probe.prompt(self.base)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot be built is a harness bug, reported as such
            return f"the probe could not be built: {exc!r}"
        before = self.outputs()
        outcome, message = self.run_prompt(prompt)
        if probe.no_overwrite and outcome == "success":
            first = self.outputs()
            outcome, message = self.run_prompt(prompt)
            changed = [p for p, data in first.items() if p.exists() and p.read_bytes() != data]
            if changed:
                return f"the second run overwrote {changed[0].name}"
        elif outcome == "success":
            changed = [p for p, data in before.items() if p.exists() and p.read_bytes() != data]
            if changed:
                return f"overwrote {changed[0].name}"
        if outcome == "hung":
            return message
        if outcome == "success":
            return None if probe.expect in (P.RUNS, P.EITHER) else "accepted (expected a refusal)"
        if probe.expect == P.RUNS:
            return f"refused (expected to run): {message[:300]}"
        raw = _raw(message)
        if raw is not None:
            return f"raw error ({raw}): {message[:300]}"
        missing = [w for w in probe.words if w not in message]
        return f"the message lacks {missing}: {message[:300]}" if missing else None


def _message(entry: dict) -> str:
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_error":
            kind_name = data.get("exception_type", "")
            text = f"{kind_name}: {data.get('exception_message', '')}"
            return text if kind_name.split(".")[-1] not in P.RAW_TYPES else f"[raw type {kind_name}] {text}"
    return str(entry["status"])


# -- faults, load and routes (need the live server) ---------------------------------------------------------------


def interrupt_mid_run(h: Harness) -> str | None:
    prompt_id = h.server.queue_ok(P.good(steps=40, seed=5))
    try:
        h.server.wait_for_step(2, timeout=PROMPT_TIMEOUT)
    except AssertionError:
        return "the sampler never reached step 2"
    h.server.post("/interrupt")
    entry = h.server.wait(prompt_id, PROMPT_TIMEOUT)
    if entry["status"]["status_str"] == "success":
        return "the interrupted prompt reported success"
    return None if not h.server.status()["running"] else "a run is still listed after the interrupt"


def release_mid_run(h: Harness) -> str | None:
    prompt_id = h.server.queue_ok(P.good(steps=20, seed=6))
    try:
        h.server.wait_for_step(2, timeout=PROMPT_TIMEOUT)
    except AssertionError:
        return "the sampler never reached step 2"
    response = h.server.post("/kvgraph/release", {"models": True})
    entry = h.server.wait(prompt_id, PROMPT_TIMEOUT)
    if not response.ok:
        return f"release answered {response.status_code}"
    return None if entry["status"]["status_str"] == "success" else "the release broke the running prompt"


def interrupt_then_queue(h: Harness) -> str | None:
    first = h.server.queue_ok(P.good(steps=40, seed=7))
    second = h.server.queue_ok(P.good(seed=8))
    try:
        h.server.wait_for_step(1, timeout=PROMPT_TIMEOUT)
    except AssertionError:
        return "the sampler never started"
    h.server.post("/interrupt")
    h.server.wait(first, PROMPT_TIMEOUT)
    entry = h.server.wait(second, PROMPT_TIMEOUT)
    return None if entry["status"]["status_str"] == "success" else "the prompt queued after an interrupt failed"


def concurrent_prompts(h: Harness, count: int = 6) -> str | None:
    ids = [h.server.queue_ok(P.good(seed=100 + i)) for i in range(count)]
    failed = [i for i in ids if h.server.wait(i, PROMPT_TIMEOUT * 2)["status"]["status_str"] != "success"]
    return f"{len(failed)} of {count} queued prompts failed" if failed else None


def status_while_running(h: Harness) -> str | None:
    prompt_id = h.server.queue_ok(P.good(steps=10, seed=9))
    errors = []

    def poll():
        for _ in range(30):
            try:
                requests.get(f"{h.server.url}/kvgraph/status", timeout=10).raise_for_status()
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROMPT_TIMEOUT)
    entry = h.server.wait(prompt_id, PROMPT_TIMEOUT)
    if errors:
        return f"status requests failed: {errors[0]}"
    return None if entry["status"]["status_str"] == "success" else "the prompt failed while its status was read"


def cancel_pending(h: Harness) -> str | None:
    running = h.server.queue_ok(P.good(steps=20, seed=10))
    pending = h.server.queue_ok(P.good(seed=11))
    h.server.post("/queue", {"delete": [pending]})
    entry = h.server.wait(running, PROMPT_TIMEOUT)
    return None if entry["status"]["status_str"] == "success" else "deleting a pending prompt broke the running one"


def _post(h: Harness, path: str, body: bytes, headers: dict) -> tuple[int, str]:
    response = requests.post(f"{h.server.url}{path}", data=body, headers=headers, timeout=30)
    return response.status_code, response.text


def route_probes() -> list[tuple[str, object]]:
    json_headers = {"Content-Type": "application/json"}

    def refused(status_range=(400, 499)):
        return lambda status, text: status_range[0] <= status <= status_range[1] and _raw(text) is None

    return [
        ("release with Origin: null", lambda h: _post(h, "/kvgraph/release", b'{"models": false}',
                                                      {**json_headers, "Origin": "null"}), refused((403, 403))),
        ("release from another origin", lambda h: _post(h, "/kvgraph/release", b'{"models": false}',
                                                        {**json_headers, "Origin": "http://evil.example"}),
         refused((403, 403))),
        ("release with a deeply nested body", lambda h: _post(h, "/kvgraph/release", b"[" * 100_000 + b"]" * 100_000,
                                                              json_headers), refused()),
        ("release with a body that is not JSON", lambda h: _post(h, "/kvgraph/release", b"{not json", json_headers),
         refused()),
        ("release with a list body", lambda h: _post(h, "/kvgraph/release", b"[1, 2]", json_headers), refused()),
        ("release with models: 'yes'", lambda h: _post(h, "/kvgraph/release", b'{"models": "yes"}', json_headers),
         refused()),
        ("release with a lone surrogate key", lambda h: _post(h, "/kvgraph/release", b'{"\\ud800": 1}', json_headers),
         lambda status, text: status < 500 and _raw(text) is None),
        ("status with a query", lambda h: (lambda r: (r.status_code, r.text))(
            requests.get(f"{h.server.url}/kvgraph/status?x=%ff%00", timeout=30)),
         lambda status, text: status == 200),
        ("an unknown pack route", lambda h: (lambda r: (r.status_code, r.text))(
            requests.get(f"{h.server.url}/kvgraph/../../etc/passwd", timeout=30)),
         lambda status, text: status == 404),
        ("GET on the release route", lambda h: (lambda r: (r.status_code, r.text))(
            requests.get(f"{h.server.url}/kvgraph/release", timeout=30)),
         lambda status, text: status in (404, 405)),
    ]


LIVE_FAMILIES = {
    "faults": [("interrupt mid-run", interrupt_mid_run), ("release models mid-run", release_mid_run),
               ("interrupt, then the next queued prompt", interrupt_then_queue)],
    "load and concurrency": [("6 prompts queued at once", concurrent_prompts),
                             ("status polled from 4 threads during a run", status_while_running),
                             ("a pending prompt deleted while another runs", cancel_pending)],
}


@pytest.fixture(scope="module")
def harness(comfyui_install, tmp_path_factory):
    base = prepare_base(tmp_path_factory.mktemp("comfyui-probes"))
    P.prepare(base)
    h = Harness(comfyui_install, base)
    yield h
    h.server.stop()


def test_every_probe_holds(harness):
    h = harness
    started = time.time()
    assert h.alive() is None, "the valid prompt does not run on a fresh server:\n" + h.server.log_tail()
    for family in P.ALL_PROMPT_FAMILIES:
        for probe in family():
            failure = h.prompt_probe(probe)
            # Liveness after every refusal: a probe that kills the prompt worker must be the one blamed.
            h.record(probe.family, probe.name, failure, check_alive=probe.expect != P.RUNS)
    for family, items in LIVE_FAMILIES.items():
        for name, probe in items:
            try:
                failure = probe(h)
            except Exception as exc:  # noqa: BLE001 - a probe's own timeout or a dead server
                failure = f"{type(exc).__name__}: {str(exc)[:200]}"
            h.record(family, name, failure)
    for name, send, holds in route_probes():
        try:
            status, text = send(h)
            failure = None if holds(status, text) else f"answered {status}: {text[:200]}"
        except Exception as exc:  # noqa: BLE001
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
        h.record("routes", name, failure, check_alive=False)
    h.record("routes", "a valid prompt after the route probes", h.alive(), check_alive=False)

    lines, failed = [], []
    for family, results in h.results.items():
        bad = [(n, f) for n, f in results if f is not None]
        lines.append(f"{family}: {len(results) - len(bad)} held, {len(bad)} failed")
        failed += [f"[{family}] {n}: {f}" for n, f in bad]
    total = sum(len(r) for r in h.results.values())
    summary = "\n".join(lines) + f"\n{total} probes in {time.time() - started:.0f} s"
    print("\nKV-Graph probes\n" + summary + ("\nfailed:\n" + "\n".join(failed) if failed else ""))
    assert not failed, summary + "\nfailed:\n" + "\n".join(failed)
