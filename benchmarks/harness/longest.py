"""The pure part of ``benchmarks/long_context.py`` (no torch): fit the profiled steps, predict a longer step's peak
memory, pinned host memory and time, search the longest length that fits, and write the markdown report.

Kept apart from the script so that the prediction is tested on its own and can be replayed from a result file.
Lengths are tokens per step (batch 1); memory is in bytes; times in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GIB = 2**30
# docs/DESIGN.md (the measured facts): allocating pinned memory costs about 0.4 s per GB. A step longer than the
# profiled ones pins new host memory once, so its first step (the confirmation) pays this on top of its predicted time.
PIN_SECONDS_PER_BYTE = 0.4 / 1e9

LIMIT_GPU = "GPU memory"
LIMIT_POOL_CAP = "host pinned cap"  # the engine's pool is full, so what it cannot take stays on the GPU
LIMIT_HOST = "host RAM"
LIMIT_TIME = "time"
LIMIT_SEARCH = "search cap"


def fmt_size(nbytes: float) -> str:
    """A size for the report and the limits' explanations: GiB, or MiB below 0.1 GiB (the CPU smoke run)."""
    return f"{nbytes / 2**20:.2f} MiB" if abs(nbytes) < GIB / 10 else f"{nbytes / GIB:.2f} GiB"


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``; needs two distinct x."""
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct lengths, got {list(xs)}")
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return mean_y - slope * mean_x, slope


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting, for the 3x3 normal equations of the free time fit."""
    a = [row[:] + [value] for row, value in zip(m, v)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (a[r][3] - sum(a[r][k] * out[k] for k in range(r + 1, 3))) / a[r][r]
    return out


@dataclass(frozen=True)
class TimeModel:
    """Step seconds = a + b * tokens + c * tokens**2, and how a, b and c were found (for the report)."""

    a: float
    b: float
    c: float
    how: str

    def __call__(self, tokens: float) -> float:
        return self.a + self.b * tokens + self.c * tokens * tokens

    def as_dict(self) -> dict[str, Any]:
        return {"a_s": self.a, "b_s_per_token": self.b, "c_s_per_token2": self.c, "how": self.how}


def attention_seconds_per_token2(layers: int, forwards_per_layer: int, forward_s: float, backward_s: float,
                                 probe_tokens: int) -> float:  # fmt: skip
    """The step's quadratic coefficient, from one attention call timed at ``probe_tokens``: every layer runs the
    attention forward ``forwards_per_layer`` times (2 under full checkpointing: forward and recompute) and backward
    once. All of the probe's time is taken as quadratic (its linear part is small at that length), which errs long."""
    return layers * (forwards_per_layer * forward_s + backward_s) / probe_tokens**2


def fit_time(tokens: Sequence[int], seconds: Sequence[float], c: float | None = None) -> TimeModel:
    """The step-time model through the profiled steps.

    With ``c`` (from the attention probe): a and b by least squares through seconds - c * tokens**2. Without it,
    three or more lengths fit a, b and c freely; two lengths cannot, so a is taken as 0 and b and c solve the two
    steps (every superlinear second is then attention's)."""
    if c is not None:
        a, b = fit_line(tokens, [s - c * t * t for t, s in zip(tokens, seconds)])
        return TimeModel(
            a,
            b,
            c,
            "a + b*t from the profiled steps (least squares) after removing c*t^2; c from "
            "the attention probe (the quadratic term is attention's alone)",
        )
    distinct = sorted(set(tokens))
    if len(distinct) >= 3:
        sums = [sum(t**k for t in tokens) for k in range(5)]
        rhs = [sum(s * t**k for t, s in zip(tokens, seconds)) for k in range(3)]
        a, b, c3 = _solve3([[sums[i + j] for j in range(3)] for i in range(3)], rhs)
        return TimeModel(a, b, c3, f"a, b, c by least squares through {len(distinct)} lengths (no attention probe)")
    if len(distinct) == 2:
        (t1, s1), (t2, s2) = ((t, sum(s for x, s in zip(tokens, seconds) if x == t) / tokens.count(t))
                              for t in distinct)  # fmt: skip
        c2 = (s2 / t2 - s1 / t1) / (t2 - t1)
        return TimeModel(
            0.0,
            s1 / t1 - c2 * t1,
            c2,
            "two lengths and no attention probe: a = 0, b and c through "
            "both steps (all superlinear time taken as attention's)",
        )
    raise ValueError(f"a time model needs two distinct lengths, got {list(tokens)}")


def pow2ceil(n: int) -> int:
    """PyTorch's pinned allocator rounds every block up to a power of two (CachingHostAllocator.h)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def pinned_pow2_bytes(sizes: Sequence[int], from_tokens: int, to_tokens: int) -> int:
    """Pinned host bytes of tensors of ``sizes`` (measured at ``from_tokens``) grown to ``to_tokens``, each rounded up
    to a power of two as PyTorch's pinned allocator does."""
    return sum(pow2ceil(math.ceil(size * to_tokens / from_tokens)) for size in sizes)


def static_bytes_per_token(plans: dict[int, int]) -> float:
    """The growth per token of the static bytes hf-offload's plans were made with, from ``{tokens: static bytes}`` of
    plans made at two lengths or more (0 with fewer). The library measures them when the first layer starts, so they
    include the step's own per-token tensors (the embeddings' output, the rotary tables); a prediction for a longer
    step that held them constant would plan with too little."""
    if len(plans) < 2:
        return 0.0
    (short, short_bytes), (long, long_bytes) = min(plans.items()), max(plans.items())
    return max(0.0, (long_bytes - short_bytes) / (long - short))


def largest_multiple(fits: Callable[[int], bool], step: int, max_tokens: int) -> int:
    """The largest multiple of ``step`` up to ``max_tokens`` for which ``fits`` holds (0 if not even ``step``), by
    bisection: ``fits`` must hold up to some length and fail beyond it."""
    low, high = 1, max_tokens // step
    if high < 1 or not fits(step):
        return 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * step):
            low = middle
        else:
            high = middle - 1
    return low * step


@dataclass(frozen=True)
class MemoryModel:
    """A mode's memory as a function of the tokens, from its profiled steps.

    GPU: a line through the measured peaks, plus, for hf-offload, the offloaded bytes past the pinned pool's cap
    (the engine keeps them on the GPU). Host: hf-offload's pool holds the offloaded bytes (a line) up to its cap;
    TRL's offloader and transformers' ``save_on_cpu`` pin each offloaded tensor in PyTorch's allocator, which rounds
    it up to a power of two and is bounded only by the host's RAM (``host_room_bytes``)."""

    peak0: float
    peak1: float
    offload0: float = 0.0  # hf-offload: bytes offloaded per step, a line in the tokens
    offload1: float = 0.0
    pool_cap_bytes: int | None = None  # hf-offload's pool cap; None: no pool
    sizes: tuple[int, ...] = ()  # TRL / native: each offloaded tensor's bytes at `sizes_tokens`
    sizes_tokens: int = 0
    host_room_bytes: int | None = None  # TRL / native: host RAM the pinned blocks may take

    def offloaded(self, tokens: int) -> float:
        return max(0.0, self.offload0 + self.offload1 * tokens)

    def excess(self, tokens: int) -> float:
        """Offloaded bytes that the pool cannot take, so they stay on the GPU."""
        if self.pool_cap_bytes is None:
            return 0.0
        return max(0.0, self.offloaded(tokens) - self.pool_cap_bytes)

    def gpu_bytes(self, tokens: int) -> float:
        return self.peak0 + self.peak1 * tokens + self.excess(tokens)

    def host_bytes(self, tokens: int) -> float:
        if self.pool_cap_bytes is not None:
            return min(self.offloaded(tokens), self.pool_cap_bytes)
        if self.sizes:
            return pinned_pow2_bytes(self.sizes, self.sizes_tokens, tokens)
        return 0.0

    def host_fits(self, tokens: int) -> bool:
        return self.host_room_bytes is None or self.host_bytes(tokens) <= self.host_room_bytes


def predict_longest(memory: MemoryModel, time: TimeModel | None, gpu_limit_bytes: int, step: int, max_tokens: int,
                    max_step_s: float) -> dict[str, Any]:  # fmt: skip
    """The longest multiple of ``step`` whose predicted peak fits ``gpu_limit_bytes`` and whose pinned host bytes
    fit, then whose predicted step fits ``max_step_s``; what stops it; and the predictions there."""

    def memory_fits(n: int) -> bool:
        return memory.gpu_bytes(n) <= gpu_limit_bytes and memory.host_fits(n)

    by_memory = largest_multiple(memory_fits, step, max_tokens)
    limit, detail = _memory_limit(memory, gpu_limit_bytes, by_memory + step, max_tokens)
    longest = by_memory
    if time is not None and by_memory and time(by_memory) > max_step_s:
        longest = largest_multiple(lambda n: memory_fits(n) and time(n) <= max_step_s, step, max_tokens)
        limit, detail = (
            LIMIT_TIME,
            (
                f"predicted {time(by_memory):.0f} s/step at {by_memory} tokens (the memory "
                f"limit), over --max-step-seconds {max_step_s:g}"
            ),
        )
    out: dict[str, Any] = {"longest_tokens": longest, "limit": limit, "limit_detail": detail,
                           "by_memory_tokens": by_memory}  # fmt: skip
    if longest:
        out.update(predicted_peak_bytes=int(memory.gpu_bytes(longest)),
                   predicted_gpu_excess_bytes=int(memory.excess(longest)))  # fmt: skip
        if memory.pool_cap_bytes is not None or memory.sizes:
            out["predicted_host_bytes"] = int(memory.host_bytes(longest))
        if time is not None:
            out["predicted_step_s"] = time(longest)
            out["predicted_tokens_per_s"] = longest / time(longest) if time(longest) > 0 else None
    return out


def _memory_limit(memory: MemoryModel, gpu_limit_bytes: int, past: int, max_tokens: int) -> tuple[str, str]:
    """What stops the length ``past`` (one step beyond the longest that fits)."""
    if past > max_tokens:
        return LIMIT_SEARCH, f"fits up to --max-tokens {max_tokens}; longer lengths were not searched"
    if not memory.host_fits(past):
        return LIMIT_HOST, (
            f"{past} tokens would pin {fmt_size(memory.host_bytes(past))} (power-of-two blocks), "
            f"over the {fmt_size(memory.host_room_bytes)} of host RAM available"
        )
    gpu = memory.gpu_bytes(past)
    excess = memory.excess(past)
    if excess and gpu - excess <= gpu_limit_bytes:
        return LIMIT_POOL_CAP, (
            f"at {past} tokens the pinned pool's cap ({fmt_size(memory.pool_cap_bytes)}) is "
            f"full: {fmt_size(excess)} of offloaded activations would stay on the GPU, "
            f"{fmt_size(gpu)} > {fmt_size(gpu_limit_bytes)}"
        )
    return LIMIT_GPU, f"{past} tokens: predicted peak {fmt_size(gpu)} > {fmt_size(gpu_limit_bytes)}"


def pinning_seconds(new_pinned_bytes: float) -> float:
    """The one-off cost of pinning ``new_pinned_bytes`` of host memory."""
    return max(0.0, new_pinned_bytes) * PIN_SECONDS_PER_BYTE


# ---------------------------------------------------------------------------------------------------- report


def _gib(nbytes: Any, fmt: str = "{:.2f}") -> str:
    """A table cell in a GiB column; below 0.1 GiB (the CPU smoke run's pretend device) in MiB, with the unit."""
    if not isinstance(nbytes, (int, float)):
        return ""
    return f"{nbytes / 2**20:.2f} MiB" if 0 < abs(nbytes) < GIB / 10 else fmt.format(nbytes / GIB)


def _size(nbytes: Any) -> str:
    return fmt_size(nbytes) if isinstance(nbytes, (int, float)) else "?"


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else ""


def _profiled(record: dict[str, Any]) -> str:
    parts = [f"{s['tokens']}: {s['s']:.2f} s, {_size(s.get('peak_bytes'))}" if s.get("ok")
             else f"{s['tokens']}: {s.get('error', 'failed')[:60]}"
             for s in record.get("steps", []) if s.get("phase") == "profile"]  # fmt: skip
    return "; ".join(parts)


def _confirmed(record: dict[str, Any]) -> list[str]:
    confirm = record.get("confirm")
    if not confirm:
        return [""] * 6
    if confirm.get("skipped"):
        return [f"skipped: {confirm['skipped']}"] + [""] * 5
    if "ok" not in confirm:
        return [f"{confirm.get('tokens')}: did not finish"] + [""] * 5
    host_min = _gib(confirm.get("host_available_min_bytes"), "{:.1f}")
    if not confirm["ok"]:
        at_failure = ""
        if confirm.get("allocated_bytes") is not None:
            at_failure = f"; allocated {_size(confirm['allocated_bytes'])}, reserved {_size(confirm['reserved_bytes'])}"
        return [f"{confirm['tokens']}: **{confirm.get('error_kind', 'failed')}** ({confirm.get('error', '')[:100]}"
                f"{at_failure})", "", "", "", "", host_min]  # fmt: skip
    return [f"{confirm['tokens']}: ok" + (f", plan `{confirm['plan']}`" if confirm.get("plan") else ""),
            _num(confirm.get("s"), "{:.1f}"), _num(confirm.get("tokens_per_s"), "{:,.0f}"),
            _gib(confirm.get("peak_bytes")), _gib(confirm.get("reserved_peak_bytes")), host_min]  # fmt: skip


def _least_host_available(results: dict[str, Any]) -> str:
    """The least host memory available during any step of the run, and in which (the host's reserve must hold
    throughout every run)."""
    sampled = [(step["host_available_min_bytes"], mode, step) for mode in results.get("order", [])
               for step in results.get("modes", {}).get(mode, {}).get("steps", [])
               if isinstance(step.get("host_available_min_bytes"), int)]  # fmt: skip
    if not sampled:
        return "Host memory available during the steps: not sampled."
    least, mode, step = min(sampled, key=lambda found: found[0])
    return (f"Host memory available during the steps (sampled while each ran), at its least: {_size(least)}, in "
            f"`{mode}`'s {step['phase']} step at {step['tokens']:,} tokens.")  # fmt: skip


def render_markdown(results: dict[str, Any]) -> str:
    """The report: one row per mode, then how each prediction was made and the notes."""
    settings = results.get("settings", {})
    env = results.get("environment", {})
    lines = [
        f"# Long context: the longest sequence per mode ({settings.get('family', 'llama3-8b')}, "
        f"{settings.get('precision', '')})",
        "",
        f"{results.get('started', '')}; device {env.get('device_name', '?')} "
        f"({_size(env.get('device_total_bytes'))}), host {_size(env.get('host_total_bytes'))}; "
        f"model: {settings.get('shape', '')}; {settings.get('precision_detail', '')}. "
        f"Prediction limit: device memory - {settings.get('margin_gib', 0):g} GiB = "
        f"{_size(env.get('gpu_limit_bytes'))} of `max_memory_allocated`; lengths are multiples of "
        f"{settings.get('round')}; steps longer than {settings.get('max_step_seconds')} s count as limited by time.",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        "| mode | status | profiled (tokens: s/step, peak GiB) | predicted longest | limit | pred. peak GiB | "
        "pred. host GiB | pred. s/step | pred. tokens/s | confirmed | s/step | tokens/s | peak GiB | reserved GiB | "
        "host avail. min GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in results.get("order", []):
        record = results.get("modes", {}).get(mode, {})
        prediction = record.get("prediction") or {}
        plan = prediction.get("plan_code")
        longest = prediction.get("longest_tokens")
        lines.append("| " + " | ".join([
            f"`{mode}`", str(record.get("status", "")), _profiled(record),
            (f"{longest:,}" if isinstance(longest, int) else "") + (f" (`{plan}`)" if plan else ""),
            str(prediction.get("limit", "")), _gib(prediction.get("predicted_peak_bytes")),
            _gib(prediction.get("predicted_host_bytes"), "{:.1f}"), _num(prediction.get("predicted_step_s"), "{:.1f}"),
            _num(prediction.get("predicted_tokens_per_s"), "{:,.0f}"), *_confirmed(record),
        ]) + " |")  # fmt: skip
    lines += ["", _least_host_available(results), "", "## How each prediction was made", ""]
    for mode in results.get("order", []):
        record = results.get("modes", {}).get(mode, {})
        prediction = record.get("prediction") or {}
        if prediction.get("how"):
            lines.append(f"- `{mode}`: " + " ".join(prediction["how"]))
        if prediction.get("limit_detail"):
            lines.append(f"  - limit: {prediction['limit_detail']}")
        if prediction.get("skipped"):
            lines.append(f"- `{mode}`: no prediction: {prediction['skipped']}")
    notes = [(mode, note) for mode in results.get("order", [])
             for note in results.get("modes", {}).get(mode, {}).get("notes", [])]  # fmt: skip
    errors = [(mode, record.get("error")) for mode, record in results.get("modes", {}).items() if record.get("error")]
    if notes or errors:
        lines += ["", "## Notes", ""]
        lines += [f"- `{mode}`: {note}" for mode, note in notes]
        lines += [f"- `{mode}` error: {error}" for mode, error in errors]
    return "\n".join(lines) + "\n"
