// The panel's model: the last status fetched from the pack's route and the phases of the last sampler run.
//
// It lives for the whole page (not just while the sidebar tab is open), so websocket events that arrive while the
// panel is closed are not lost, and reopening the tab shows the last run at once. It takes the ComfyUI `api` object as
// a parameter instead of importing it, so the browser tests can drive it with a stub.

export const STATUS_ROUTE = "/kvgraph/status";
export const RELEASE_ROUTE = "/kvgraph/release";

export class StatusStore {
  constructor(api) {
    this.api = api;
    this.status = null; // the last GET /kvgraph/status payload
    this.error = null; // why the last fetch failed, shown above the last numbers that did arrive
    this.updatedAt = null;
    this.loading = false;
    this.lastRun = null; // {prompt_id, node, phases: [{phase, at, data}], summary}
    this.listeners = new Set();
    this._pending = null;
    this._followUp = null;
  }

  /** Call `fn(store)` on every change; returns the unsubscribe function. */
  subscribe(fn) {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  _changed() {
    for (const fn of this.listeners) {
      try {
        fn(this);
      } catch (err) {
        console.error("[KV-Graph] panel update failed", err);
      }
    }
  }

  /**
   * Fetch the status. Callers during a fetch share one follow-up fetch after it: the one in flight may have left
   * before what they want to see (a run's `done` arriving while the `prefill` refresh is on its way).
   */
  refresh() {
    if (this._pending) {
      this._followUp ??= this._pending.then(() => {
        this._followUp = null;
        return this.refresh();
      });
      return this._followUp;
    }
    this.loading = true;
    this._pending = (async () => {
      try {
        const response = await this.api.fetchApi(STATUS_ROUTE, { cache: "no-store" });
        if (!response.ok) throw new Error(`${STATUS_ROUTE} answered ${response.status}`);
        this.status = await response.json();
        this.error = null;
      } catch (err) {
        this.error = err?.message || String(err);
      } finally {
        this.loading = false;
        this.updatedAt = new Date();
        this._pending = null;
        this._changed();
      }
      return this.status;
    })();
    return this._pending;
  }

  /** POST the release route; returns its JSON answer, and refreshes so the panel shows what is left. */
  async release(models = false) {
    const response = await this.api.fetchApi(RELEASE_ROUTE, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ models }),
    });
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    if (!response.ok) throw new Error(body?.error || `${RELEASE_ROUTE} answered ${response.status}`);
    await this.refresh();
    return body;
  }

  /**
   * Record one `kvgraph.status` websocket event. A new (prompt, node) pair starts a new "last run": a prompt with two
   * samplers shows the one that ran last, which is the one whose numbers the status route now reflects.
   */
  handleEvent(detail) {
    if (!detail || typeof detail !== "object") return;
    const sameRun = this.lastRun && this.lastRun.prompt_id === detail.prompt_id && this.lastRun.node === detail.node
      && !this.lastRun.summary;
    if (!sameRun) {
      this.lastRun = { prompt_id: detail.prompt_id ?? null, node: detail.node ?? null, phases: [], summary: null };
    }
    this.lastRun.phases.push({ phase: detail.phase, at: new Date(), data: detail });
    if (detail.phase === "done") this.lastRun.summary = detail;
    this._changed();
    // The route changes when a run starts (it is listed as running), at capture time and when the run ends; fetch
    // then rather than on every event.
    if (["prefill", "capture", "done"].includes(detail.phase)) this.refresh();
  }
}
