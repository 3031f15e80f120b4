"""The README lines for ``bench/serving.py`` (a stage as a server); bench/report.py calls it."""

from __future__ import annotations

from typing import Any

GiB = 1024**3


def ok(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _steps(steps: dict[str, Any] | None) -> str:
    if not steps:
        return ""
    return (
        f" ({steps['mean_rows']:.1f} rows per step on average, "
        f"{steps['ms_per_step']:.1f} ms per step)"
    )


def serving_section(
    data: dict[str, Any],
    earlier: dict[str, Any] | None = None,
    others: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """The torch AR stage under concurrent HTTP clients against batched ``generate``, under
    sleep/wake, and diffusion images/s (from ``earlier``, a previous run, when this one made
    none); ``others``: more runs of the same code, by file name, whose 16-client ratio and
    swaps are listed; a ``--smoke`` run on CPU is not rendered."""
    if data.get("smoke"):
        return []
    m, llm, s = data["machine"], data["llm"], data["summary"]
    plan = data["plan"]
    lines = [
        "",
        f"A stage as a server, `bench/serving.py` on {m.get('gpu', '?')} ({m['date'][:10]}, "
        f"transformers {m.get('transformers', '?')}): the torch AR stage with a "
        f"{llm['weights_bytes'] / GiB:.1f} GiB Llama-shaped bf16 model (random weights), "
        f"{plan['new_tokens']} new tokens per request (greedy, no stop), closed-loop clients "
        f"over the worker's OpenAI HTTP API (`--max-batch {plan['max_batch']}`), against the "
        f"same weights' `model.generate` batched in the same run; tokens/s over "
        f"{plan['window_s']:g} s windows.",
        "",
        "| load | stage tokens/s | `generate`, same batch | stage / `generate` |",
        "|---|---|---|---|",
    ]
    for clients, rate in s["torch_tokens_per_s"].items():
        batched = s["generate_tokens_per_s"].get(clients)
        ratio = f"{rate / batched:.2f}" if batched else "-"
        base = f"{batched:.1f}" if batched else "-"
        lines.append(f"| {clients} client(s) | {rate:.1f} | {base} | {ratio} |")
    lines.append(
        f"| **16 clients of batched** | | | **{s['torch_16_clients_of_batched']:.2f}** (goal 0.8) |"
    )
    settled = data.get("settle")
    if settled:
        done = "ended" if settled["host_copy_pinned"] else "had not ended"
        lines += [
            "",
            f"Before the windows the worker's host copy was page-locked in the background "
            f"(start-up work that steps aside for requests): it {done} "
            f"{settled['waited_s']:.1f} s after Active.",
        ]
    if "batcher_in_process" in llm:
        inner = llm["batcher_in_process"]
        middle = str(plan["clients"][1])
        lines += [
            "",
            f"The batcher alone in the bench process (no worker, no HTTP): one request "
            f"{inner['one']:.1f} tokens/s; {middle} closed-loop threads "
            f"{inner[f'closed_loop_{middle}']:.1f} tokens/s"
            + _steps(inner.get(f"closed_loop_{middle}_steps"))
            + ".",
        ]
    if "swaps" in s:
        swaps = data["swaps"]
        lines += [
            "",
            f"Sleep (level 1) and wake every {swaps['swap_every_s']:g} s for "
            f"{swaps['seconds']:g} s with {swaps['clients']} clients: {s['swaps']} swaps, every "
            f"ACK ok: {ok(s['swaps_all_acks_ok'])}; {swaps['requests']} requests, nothing "
            f"lost: {ok(s['swaps_nothing_lost'])}; tokens/s between swaps "
            f"{s['swaps_window_ratio_min']:.2f}-{max(swaps['window_ratio_to_steady']):.2f} x "
            f"the steady 16-client figure (median {s['swaps_window_ratio_median']:.2f}).",
        ]
    if others:
        runs = [("this run", s)] + [(f"`{name}`", o["summary"]) for name, o in others.items()]
        ratios = [r["torch_16_clients_of_batched"] for _, r in runs]
        listed = ", ".join(f"{r['torch_16_clients_of_batched']:.2f} ({n})" for n, r in runs)
        met = "met in every run" if min(ratios) >= 0.8 else "**not met reliably**"
        lines += [
            "",
            f"16 clients of batched in runs of the batcher with CUDA graphs: {listed}; the "
            f"goal is {met}.",
        ]
        for name, o in others.items():
            os_, sw = o["summary"], o.get("swaps") or {}
            if os_.get("swaps") and sw:
                lines.append(
                    f"In `{name}`, sleep and wake every {sw['swap_every_s']:g} s for "
                    f"{sw['seconds']:g} s with {sw['clients']} clients: {os_['swaps']} swaps, "
                    f"every ACK ok: {ok(os_['swaps_all_acks_ok'])}; {sw['requests']} requests, "
                    f"nothing lost: {ok(os_['swaps_nothing_lost'])}."
                )
    images = data.get("images") or []
    source = ""
    if not images and earlier is not None:
        images = earlier.get("images") or []
        when = earlier["machine"]["date"][:16].replace("T", " ")
        source = f" (the earlier run on {earlier['machine'].get('gpu', '?')}, {when} UTC)"
    if images:
        figures = "; ".join(
            f"{run['clients']} client(s) {run['images_per_s']:.2f} images/s ("
            + ", ".join(f"{n} in batches of {b}" for b, n in run["batch_sizes"].items())
            + ")"
            for run in images
        )
        lines += [
            "",
            f"Diffusion stage (an SD-like pipeline from configs, {plan['image_side']}x"
            f"{plan['image_side']}, {plan['image_steps']} steps, `--max-batch 8`), concurrent "
            f"same-size requests over gRPC{source}: {figures}.",
        ]
    return lines


def decode_graphs_section(data: dict[str, Any]) -> list[str]:
    """The batcher's plain decode steps as CUDA graphs against the same steps run eagerly
    (``bench/decode_graphs.py``); a ``--smoke`` run on CPU is not rendered."""
    if data.get("device") != "cuda":
        return []
    s = data["summary"]
    runs = data["speed"]
    graphs, eager = runs["graphs"], runs["eager"]
    ident = data["identity_float32"]
    left = s["left_on_device_mib"]
    return [
        "",
        f"Where the stage's speed comes from, `bench/decode_graphs.py` on {data.get('gpu', '?')} "
        f"(transformers {data['transformers']}): the worker's batcher in one process, the "
        f"{data['weights_bytes'] / GiB:.1f} GiB model, {graphs[0]['clients']} closed-loop "
        f"threads, plain decode steps replayed as CUDA graphs against the same steps run "
        f"eagerly, in turns: **{s['graphs_over_eager']:.2f}x** the tokens/s "
        f"({s['tokens_per_s']['graphs']:.0f} against {s['tokens_per_s']['eager']:.0f}; "
        f"{graphs[0]['ms_per_step']:.1f} against {eager[0]['ms_per_step']:.1f} ms per step, "
        f"{graphs[0]['captures']} captures taking {graphs[0]['capture_seconds']:.2f} s of the "
        f"run), one request {s['one_request_graphs_over_eager']:.2f}x. Greedy tokens of "
        f"{ident['graphs']['requests']} requests joining a running batch (float32) equal each "
        f"request run alone: {ident['graphs']['identical']} of {ident['graphs']['requests']} "
        f"with graphs, {ident['eager']['identical']} eagerly. Left on the device once the "
        f"batches ended: {left['graphs']:.0f} MiB with graphs, {left['eager']:.0f} MiB eagerly.",
    ]
