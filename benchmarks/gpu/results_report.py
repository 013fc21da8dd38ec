"""results.md from the kit's results.json: what each figure is, in tables a reader scans."""

from __future__ import annotations

from typing import Any


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [
        "# pagedray GPU readiness kit" + (" (dry run, CPU)" if results["dry_run"] else ""),
        "",
        f"{results['started']}: {_device(env)}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"triton {env['triton']}, Python {env['python']}, {env['cpu_count']} CPUs.",
        "",
        "| stage | status | seconds |",
        "|---|---|---|",
    ]
    stages = results["stages"]
    for name, stage in stages.items():
        note = f" ({stage['note']})" if "note" in stage else ""
        lines.append(f"| {name} | {stage['status']}{note} | {stage.get('seconds', '')} |")
    for name, render in (
        ("kernels", _kernels),
        ("equality", _equality),
        ("decode_table", _decode_table),
        ("throughput", _throughput),
        ("host_tier", _host_tier),
    ):
        data = stages.get(name, {}).get("data")
        if data:
            lines += ["", *render(data)]
    return "\n".join(lines) + "\n"


def _device(env: dict[str, Any]) -> str:
    if env.get("device") in (None, "cpu"):
        return "no GPU (the CPU: Triton's interpreter, the torch reference)"
    return (
        f"{env['device']} (compute {env['compute_capability']}, {env['memory_gib']} GiB, "
        f"{env['multiprocessors']} SMs)"
    )


def _kernels(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Triton kernels against the torch reference (`pytest -m gpu`)",
        "",
        f"{data['tests']} cases: {data['failures']} failed, {data['errors']} errors, "
        f"{data['skipped']} skipped.",
    ]
    lines += [f"- `{f['test']}`: {f['message']}" for f in data["failed"][:20]]
    return lines


def _equality(data: dict[str, Any]) -> list[str]:
    lines = ["## Greedy tokens against transformers (fp32, 3 prompts x 16 tokens)", ""]
    for arch, result in data.items():
        if isinstance(result, dict):
            lines.append(f"- {arch}: {'equal' if result['equal'] else 'DIFFERENT'}")
    return lines


def _decode_table(data: dict[str, Any]) -> list[str]:
    copy = data["copy_bytes_per_s"]
    lines = [
        "## Paged decode (32 query / 8 KV heads, head size 128, bf16, block 16)",
        "",
        f"Device copy: {copy / 1e9:.0f} GB/s (read + write). Bandwidth = K/V bytes read / time.",
        "",
        "| batch | context | paged ms | K/V MB | GB/s | of copy | SDPA (dense) ms | flex ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        flex = f"{row['flex_s'] * 1e3:.3f}" if row.get("flex_s") else row.get("flex_note", "")
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['paged_s'] * 1e3:.3f} | "
            f"{row['kv_bytes'] / 1e6:.1f} | {row['paged_bytes_per_s'] / 1e9:.0f} | "
            f"{row['paged_vs_copy']:.2f} | {row['sdpa_s'] * 1e3:.3f} | {flex} |"
        )
    return lines


def _throughput(data: dict[str, Any]) -> list[str]:
    lines = [
        f"## Throughput: {data['model']} ({data['parameters'] / 1e9:.2f}B parameters, "
        f"{data['dtype']}), {data['num_requests']} requests, {data['output_tokens']} output tokens",
        "",
        "| system | output tok/s | pagedray / it |",
        "|---|---|---|",
    ]
    systems = data["systems"]
    ours = systems.get("pagedray", {}).get("output_tokens_per_s")
    for name, result in systems.items():
        if "error" in result:
            lines.append(f"| {name} | error: {result['error'][:120]} | |")
            continue
        rate = result["output_tokens_per_s"]
        ratio = f"{ours / rate:.2f}x" if ours else ""
        lines.append(f"| {name} | {rate:,.0f} | {ratio} |")
    return lines


def _host_tier(data: dict[str, Any]) -> list[str]:
    lines = [
        f"## Host KV tier: device pool <-> tier file ({data['device']}, "
        f"{data['block_bytes']} bytes a block)",
        "",
        "| blocks | MiB | save ms | load ms | save GB/s | load GB/s | pinned copy GB/s "
        "| pageable copy GB/s | save / pinned | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['blocks']} | {row['mib']} | {row['save_ms']} | {row['load_ms']} | "
            f"{row['save_gbps']} | {row['load_gbps']} | {row['pinned_copy_gbps']} | "
            f"{row['pageable_copy_gbps']} | {row['save_of_pinned']} | {row['bit_identical']} |"
        )
    return lines
