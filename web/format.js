// Pure formatting helpers for the KV-Graph panel and toasts.
//
// No DOM and no ComfyUI imports here, so the browser tests can import this module on its own and the panel stays a
// thin layer over these functions. Every helper tolerates missing fields: the status payload is produced by another
// process and an older or newer pack may send fewer or more keys.

/** Bytes as a short human string: "0 B", "812 KiB", "1.5 GiB". */
export function formatBytes(bytes) {
  const n = Number(bytes);
  if (!Number.isFinite(n) || n <= 0) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  // One decimal below 10 of a unit keeps small caches readable without long numbers for big ones.
  const digits = unit === 0 || value >= 10 ? 0 : 1;
  return `${value.toFixed(digits)} ${units[unit]}`;
}

/** Milliseconds with a precision that suits their size. */
export function formatMs(ms) {
  const n = Number(ms);
  if (!Number.isFinite(n)) return "?";
  if (n >= 10000) return `${(n / 1000).toFixed(1)} s`;
  if (n >= 100) return `${Math.round(n)} ms`;
  return `${n.toFixed(1)} ms`;
}

/** The file name of a model path (the route sends absolute paths; the folder is noise in a narrow sidebar). */
export function baseName(path) {
  if (!path) return "";
  const parts = String(path).split(/[\\/]/).filter(Boolean);
  return parts.length ? parts[parts.length - 1] : String(path);
}

/** "no CUDA: 39, hooks: 2", or "none". Sorted by count so the dominant reason comes first. */
export function formatReasons(counts) {
  const items = Object.entries(counts || {}).filter(([, n]) => n > 0);
  if (!items.length) return "none";
  items.sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  return items.map(([reason, n]) => `${reason}: ${n}`).join(", ");
}

/** Sum of a {reason: count} map. */
export function sumCounts(counts) {
  return Object.values(counts || {}).reduce((total, n) => total + (Number(n) || 0), 0);
}

/**
 * Image shapes of a graph key, as "cond 32×48, target 64×64" (latent patches; frame count dropped when 1).
 * The target image is always the last shape: the condition images come first in the joint sequence.
 */
export function formatImageShapes(shapes) {
  if (!Array.isArray(shapes) || !shapes.length) return "";
  const one = (shape) => {
    const dims = Array.isArray(shape) ? shape.slice() : [shape];
    if (dims.length === 3 && dims[0] === 1) dims.shift();
    return dims.join("×");
  };
  const target = one(shapes[shapes.length - 1]);
  const conds = shapes.slice(0, -1).map(one);
  return conds.length ? `cond ${conds.join(", ")}; target ${target}` : `target ${target}`;
}

/** One line naming a graph key: branch, batch and token counts (what makes two keys differ at a glance). */
export function formatKeyTitle(key) {
  if (!key) return "unknown key";
  const parts = [key.branch ?? "?", `batch ${key.batch ?? "?"}`];
  parts.push(`${key.prefix_tokens ?? "?"} prefix + ${key.target_tokens ?? "?"} target tokens`);
  return parts.join(" · ");
}

/** The second line of a graph key: image layout, dtype, device and attention backend. */
export function formatKeyDetail(key) {
  if (!key) return "";
  const placement = key.prefix_placement ? `prefix ${key.prefix_placement}` : null;
  return [formatImageShapes(key.image_shapes), key.dtype, key.device, key.backend, placement].filter(Boolean).join(" · ");
}

/** Where the prefills put their prefix K/V (gpu, int8, host, recompute: counts), or "" before any. */
export function describePlacements(stats) {
  const counts = stats?.prefix_placements || {};
  const names = Object.keys(counts);
  if (!names.length) return "";
  const label = (name) => (name === "recompute" ? "recompute (no prefix cache, eager)" : name);
  return `prefix K/V: ${names.map((name) => `${label(name)} ${counts[name]}`).join(" · ")}`;
}

/** Totals over every model in a status payload (the numbers shown at the top of the panel). */
export function totals(status) {
  const out = { models: 0, entries: 0, captures: 0, replays: 0, eagerSteps: {}, eagerTotal: 0, skipped: 0, bytes: 0 };
  for (const model of status?.models || []) {
    if (model.error) continue;
    out.models += 1;
    out.entries += (model.entries || []).length;
    out.captures += Number(model.captures) || 0;
    out.replays += Number(model.replays) || 0;
    out.skipped += Number(model.skipped_steps) || 0;
    out.bytes += Number(model.bytes_held) || 0;
    for (const [reason, n] of Object.entries(model.eager_steps || {})) {
      out.eagerSteps[reason] = (out.eagerSteps[reason] || 0) + (Number(n) || 0);
    }
  }
  out.eagerTotal = sumCounts(out.eagerSteps);
  return out;
}

/** A short id for display: prompt ids are UUIDs, the first block is enough to match the queue panel. */
export function shortId(id) {
  if (!id) return "?";
  return String(id).split("-")[0];
}

/** One line describing a `kvgraph.status` websocket event, for the panel's "last run" list. */
export function describePhase(event) {
  const d = event || {};
  switch (d.phase) {
    case "prefill": {
      const tokens = d.prefix_tokens != null ? ` · ${d.prefix_tokens} prefix + ${d.target_tokens} target tokens` : "";
      return `prefill ${d.ms != null ? formatMs(d.ms) : ""}${tokens}`.trim();
    }
    case "capture":
      return `captured a decode graph (${d.branch ?? "?"}, step ${d.step ?? "?"})`;
    case "replay":
      return `replaying decode graphs from step ${d.step ?? "?"}`;
    case "fallback":
      return `eager decode (${d.branch ?? "?"}): ${d.reason ?? "unknown reason"}`;
    case "done":
      return `done: ${describeRunSummary(d)}`;
    default:
      return String(d.phase ?? "unknown phase");
  }
}

/** How a model's prefills ran (captured prefix passes, replays, eager ones by reason), or "" before any. */
export function describePrefills(stats) {
  const d = stats || {};
  const eager = sumCounts(d.eager_prefills);
  if (!d.prefill_captures && !d.prefill_replays && !eager) return "";
  const parts = [`${d.prefill_replays ?? 0} replayed`, `${d.prefill_captures ?? 0} captured`];
  parts.push(eager ? `${eager} eager (${formatReasons(d.eager_prefills)})` : "0 eager");
  return `prefills: ${parts.join(" · ")}`;
}

/** The `done` event's statistics as one line. */
export function describeRunSummary(d) {
  const parts = [`${d.captures ?? 0} captures`, `${d.replays ?? 0} replays`];
  const eager = sumCounts(d.eager_steps);
  parts.push(eager ? `${eager} eager (${formatReasons(d.eager_steps)})` : "0 eager");
  if (d.skipped_steps) parts.push(`${d.skipped_steps} skipped (step cache)`);
  const placements = Object.keys(d.prefix_placements || {}).filter((name) => name !== "gpu");
  if (placements.length) parts.push(`prefix ${placements.join("+")}`);
  if (d.prefill_ms != null) {
    const how = sumCounts(d.eager_prefills) ? " eager" : d.prefill_captures ? " captured" : d.prefill_replays ? " replayed" : "";
    parts.push(`prefill ${formatMs(d.prefill_ms)}${how}`);
  }
  if (d.decode_ms_per_step != null) parts.push(`decode ${formatMs(d.decode_ms_per_step)}/step`);
  if (d.capture_seconds) parts.push(`capture ${formatMs(d.capture_seconds * 1000)}`);
  if (d.compiled) parts.push("compiled blocks");
  return parts.join(" · ");
}

/**
 * The release route's answer as toast text. `before` (the status fetched before releasing, optional) names each
 * model by its file and says how many graph entries went, which the route's answer alone does not.
 */
export function describeRelease(result, before = null) {
  const graphs = result?.graphs || [];
  const models = result?.models || [];
  if (!graphs.length && !models.length) return "No graph cache was held.";
  const known = new Map((before?.models || []).map((m) => [m.engine_id, m]));
  const lines = graphs.map((g) => {
    const prior = known.get(g.engine_id);
    const name = prior?.source ? baseName(prior.source) : (g.model ?? "graph cache");
    const count = prior?.entries ? `${prior.entries.length} graph ${prior.entries.length === 1 ? "entry" : "entries"}, ` : "";
    const what = g.result === "deferred" ? "released when its run ends" : g.result;
    return `${name}: ${what} (${count}${formatBytes(g.bytes)})`;
  });
  for (const m of models) {
    lines.push(`${m.kind} ${baseName(m.source)}: dropped${m.unloaded ? "" : " (unloads when its run ends)"}`);
  }
  return lines.join("\n");
}
