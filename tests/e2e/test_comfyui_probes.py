"""Re-run of issue 43's adversarial probe families on a real ComfyUI (CPU, tiny models): paths, damaged files, inputs,
faults, load and concurrency, routes. The probes are data (tests/e2e/probes.py); this module starts ONE server (again
only if a probe leaves it unable to run prompts, and that probe fails) and sends each probe, bounded in time.

A probe holds when the user gets a clear answer (a refusal whose message carries no raw Python exception, or a
success where one is expected), no file is overwritten, and the server still runs the next valid prompt. The counts
per family are printed (held / failed), and the test fails listing every probe that did not hold.

KVGRAPH_PROBES=<text> runs only the probes whose "family: name" contains the text (to re-check a few after a fix).
"""

from __future__ import annotations

import json
import os
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

SELECTED = os.environ.get("KVGRAPH_PROBES", "").lower()
PROMPT_TIMEOUT = 45.0  # seconds a probe's prompt may take on the CPU before it counts as hung
# ComfyUI's prompt worker is one thread: when it dies (an exception its own error handling cannot survive), the
# process lives on and every later prompt waits forever. Its last words in the log name it.
WORKER_DIED = "(prompt_worker)"


# The server's address space is capped: a damaged config that builds a huge model (issue 43: 12+ GB before the kernel
# killed the server) must fail inside the cap, not take memory from the rest of the machine. The tiny models run in
# well under it (ComfyUI on the CPU maps ~4 GiB at rest).
ADDRESS_SPACE = 7 << 30


class WorkerDied(RuntimeError):
    pass


def start_capped(install, base):
    import resource

    server = start_server(install, base)
    resource.prlimit(server.process.pid, resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    return server


def _raw(text: str) -> str | None:
    return next((marker for marker in P.RAW_MARKERS if marker in text), None)


class Harness:
    def __init__(self, install, base):
        self.install, self.base = install, base
        self.server = start_capped(install, base)
        self.results: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
        self.restarts = 0
        self.seed = 0
        self.last_outcome = ""

    def restart(self) -> None:
        self.server.stop()
        self.server = start_capped(self.install, self.base)
        self.restarts += 1

    def usable(self) -> bool:
        log = self.server.log_path.read_text(errors="replace")
        return self.server.process.poll() is None and WORKER_DIED not in log

    def wait(self, prompt_id: str, timeout: float = PROMPT_TIMEOUT) -> dict:
        """The prompt's history entry; WorkerDied as soon as the server can no longer run prompts."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.usable():
                raise WorkerDied("the server stopped running prompts (its prompt worker died)")
            history = self.server.get(f"/history/{prompt_id}")
            entry = history.get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"no answer within {timeout:.0f} s")

    def alive(self) -> str | None:
        """None when the server runs a valid prompt now (one step, a new seed: the sampler, decode and save run
        again), else why not."""
        self.seed += 1
        prompt = P.good(steps=1, seed=10_000 + self.seed)
        prompt[P.ENCODE]["inputs"].update(width=32, height=32)  # a 2x2-token image: the check costs little
        try:
            entry = self.wait(self.server.queue_ok(prompt))
        except Exception as exc:  # noqa: BLE001 - a dead or hung server is what is measured
            return f"the next valid prompt did not run ({exc})"
        if entry["status"]["status_str"] != "success":
            return "the next valid prompt failed: " + _message(entry)
        return None

    def answers(self) -> str | None:
        """None when the server still answers HTTP (after a probe refused at validation, which runs no node)."""
        try:
            self.server.get("/queue")
        except Exception as exc:  # noqa: BLE001
            return f"the server stopped answering ({type(exc).__name__})"
        return None

    def record(self, probe_family: str, name: str, failure: str | None, check_alive: bool = True) -> None:
        if failure is None and check_alive:
            failure = self.alive() if self.last_outcome != "validation" else self.answers()
        print(f"  [{probe_family}] {name}: {failure or 'held'}", flush=True)
        if not self.usable() or (failure and ("did not run" in failure or "no answer" in failure)):
            self.restart()  # the next probe gets a working server; this one is blamed
        self.results[probe_family].append((name, failure))

    # -- prompt probes ---------------------------------------------------------------------------------------------

    def outputs(self) -> dict[Path, tuple]:
        """Every file under output/ (and the absolute-prefix probe's folder) with its identity: a file replaced (by a
        rename over it) gets a new inode, one rewritten in place a new modification time, even when the same seed
        writes the same bytes."""
        files = [p for p in (self.base / "output").rglob("*") if p.is_file()]
        files += [p for p in Path("/tmp").glob("kvgraph_probe*") if p.is_file()]
        return {p: _identity(p) for p in files}

    def run_prompt(self, prompt: dict) -> tuple[str, str]:
        """('validation' | 'error' | 'success' | 'hung', the message shown)."""
        # Encoded here, not by requests: a probe may hold NaN, which Python's JSON writes as ComfyUI's parser reads it.
        body = json.dumps({"prompt": prompt, "client_id": self.server.client_id})
        response = requests.post(f"{self.server.url}/prompt", data=body.encode("utf-8", "surrogatepass"),
                                 headers={"Content-Type": "application/json"}, timeout=30)
        if response.status_code != 200:
            return "validation", response.text
        try:
            entry = self.wait(response.json()["prompt_id"])
        except (TimeoutError, WorkerDied) as exc:
            return "hung", str(exc)
        if entry["status"]["status_str"] == "success":
            return "success", ""
        return "error", _message(entry)

    def prompt_probe(self, probe: P.Probe) -> str | None:
        try:
            prompt = probe.prompt(self.base)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot be built is a harness bug, reported as such
            return f"the probe could not be built: {exc!r}"
        before = self.outputs()
        try:
            outcome, message = self.run_prompt(prompt)
        except requests.RequestException as exc:
            self.last_outcome = "hung"
            return f"the server did not answer the prompt: {type(exc).__name__}"
        self.last_outcome = outcome
        if probe.no_overwrite and outcome == "success":
            first = self.outputs()
            # Another seed, so ComfyUI's cache does not skip the second run: the sampler and the save run again.
            prompt[P.SAMPLER]["inputs"]["seed"] += 1
            outcome, message = self.run_prompt(prompt)
            changed = [p for p, ident in first.items() if _identity(p) != ident]
            if changed:
                return f"the second run overwrote {changed[0].name}"
        elif outcome == "success":
            changed = [p for p, ident in before.items() if _identity(p) != ident]
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


def _selected(family: str, name: str) -> bool:
    return SELECTED in f"{family}: {name}".lower()


def _identity(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None  # gone: deleted or replaced
    return st.st_ino, st.st_mtime_ns, st.st_size


def _message(entry: dict) -> str:
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_error":
            kind_name = data.get("exception_type", "")
            text = f"{kind_name}: {data.get('exception_message', '')}"
            return text if kind_name.split(".")[-1] not in P.RAW_TYPES else f"[raw type {kind_name}] {text}"
    return str(entry["status"])


# -- faults, load and routes (need the live server) ---------------------------------------------------------------


class NeverStarted(RuntimeError):
    pass


def _running(h: Harness, steps: int, seed: int, step: int = 2) -> str:
    """Queue a valid prompt and return its id once its sampler reached `step`."""
    prompt_id = h.server.queue_ok(P.good(steps=steps, seed=seed))
    try:
        h.server.wait_for_step(step, timeout=PROMPT_TIMEOUT)
    except AssertionError:
        raise NeverStarted(f"the sampler never reached step {step}") from None
    return prompt_id


def interrupt_mid_run(h: Harness) -> str | None:
    prompt_id = _running(h, 40, 5)
    h.server.post("/interrupt")
    entry = h.wait(prompt_id)
    if entry["status"]["status_str"] == "success":
        return "the interrupted prompt reported success"
    return None if not h.server.status()["running"] else "a run is still listed after the interrupt"


def release_mid_run(h: Harness) -> str | None:
    prompt_id = _running(h, 20, 6)
    response = h.server.post("/kvgraph/release", {"models": True})
    entry = h.wait(prompt_id)
    if not response.ok:
        return f"release answered {response.status_code}"
    return None if entry["status"]["status_str"] == "success" else "the release broke the running prompt"


def interrupt_then_queue(h: Harness) -> str | None:
    first = _running(h, 40, 7, step=1)
    second = h.server.queue_ok(P.good(seed=8))
    h.server.post("/interrupt")
    h.wait(first)
    entry = h.wait(second)
    return None if entry["status"]["status_str"] == "success" else "the prompt queued after an interrupt failed"


def _file_changed_mid_run(h: Harness, name: str, change) -> str | None:
    """A prompt sampling from `name`'s weights while the file is changed on disk: that prompt finishes with the weights
    it loaded, and a later prompt naming the file gets a clear refusal (or loads it again if it is still whole)."""
    prompt = P.good(steps=20, seed=12)
    prompt["1"]["inputs"]["transformer_name"] = name
    prompt_id = h.server.queue_ok(prompt)
    h.server.wait_for_step(2, timeout=PROMPT_TIMEOUT)
    change(h.base / "models" / "diffusion_models" / name)
    if h.wait(prompt_id)["status"]["status_str"] != "success":
        return "the prompt sampling from the file failed when the file changed"
    again = P.good(seed=13)
    again["1"]["inputs"]["transformer_name"] = name
    outcome, message = h.run_prompt(again)
    if outcome in ("hung", "success"):
        return None if outcome == "success" else message
    raw = _raw(message)
    return f"raw error ({raw}): {message[:300]}" if raw else None


def truncate_mid_run(h: Harness) -> str | None:
    def truncate(path):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    return _file_changed_mid_run(h, P.FAULT_FILES[0], truncate)


def delete_mid_run(h: Harness) -> str | None:
    return _file_changed_mid_run(h, P.FAULT_FILES[1], lambda path: path.unlink())


def concurrent_prompts(h: Harness, count: int = 6) -> str | None:
    ids = [h.server.queue_ok(P.good(seed=100 + i)) for i in range(count)]
    failed = [i for i in ids if h.wait(i, PROMPT_TIMEOUT * 2)["status"]["status_str"] != "success"]
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
    entry = h.wait(prompt_id)
    if errors:
        return f"status requests failed: {errors[0]}"
    return None if entry["status"]["status_str"] == "success" else "the prompt failed while its status was read"


def cancel_pending(h: Harness) -> str | None:
    running = h.server.queue_ok(P.good(steps=20, seed=10))
    pending = h.server.queue_ok(P.good(seed=11))
    h.server.post("/queue", {"delete": [pending]})
    entry = h.wait(running)
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
               ("interrupt, then the next queued prompt", interrupt_then_queue),
               ("the transformer file truncated mid-run", truncate_mid_run),
               ("the transformer file deleted mid-run", delete_mid_run)],
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
            if not _selected(probe.family, probe.name):
                continue
            failure = h.prompt_probe(probe)
            # Liveness after every refusal: a probe that kills the prompt worker must be the one blamed.
            h.record(probe.family, probe.name, failure, check_alive=probe.expect != P.RUNS)
    h.last_outcome = ""
    for family, items in LIVE_FAMILIES.items():
        for name, probe in items:
            if not _selected(family, name):
                continue
            try:
                failure = probe(h)
            except Exception as exc:  # noqa: BLE001 - a probe's own timeout or a dead server
                failure = f"{type(exc).__name__}: {str(exc)[:200]}"
            h.record(family, name, failure)
    for name, send, holds in route_probes():
        if not _selected("routes", name):
            continue
        try:
            status, text = send(h)
            failure = None if holds(status, text) else f"answered {status}: {text[:200]}"
        except Exception as exc:  # noqa: BLE001
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
        h.record("routes", name, failure, check_alive=False)
    h.record("routes", "a valid prompt after the route probes", h.alive(), check_alive=False)
    summary_restarts = h.restarts

    lines, failed = [], []
    for family, results in h.results.items():
        bad = [(n, f) for n, f in results if f is not None]
        lines.append(f"{family}: {len(results) - len(bad)} held, {len(bad)} failed")
        failed += [f"[{family}] {n}: {f}" for n, f in bad]
    total = sum(len(r) for r in h.results.values())
    summary = "\n".join(lines) + (f"\n{total} probes in {time.time() - started:.0f} s, the server restarted "
                                    f"{summary_restarts} times after a probe left it unable to run prompts")
    print("\nKV-Graph probes\n" + summary + ("\nfailed:\n" + "\n".join(failed) if failed else ""))
    assert not failed, summary + "\nfailed:\n" + "\n".join(failed)
