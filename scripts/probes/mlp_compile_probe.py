"""Whether compiling the LM layer's output projection and MLP with every size symbolic
(`torch.compile(dynamic=True)`) costs time against sizes known at compile time, at random-3b's
widths; prints JSON (ms per call) and the generated silu(gate) * up kernel of each. The answer
(2026-11-26, H200: the kernel took 2.0-2.5x as long with symbolic widths) is why lm.py marks only
the token count dynamic (`tokens_vary`).

    PYTHONPATH=. python3 scripts/probes/mlp_compile_probe.py
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from common.engine.lm import _output_and_mlp

HIDDEN, MLP, HEADS, HEAD_DIM = 2048, 11008, 16, 128  # random-3b
TOKENS = (4096, 3940, 4104)  # 8 chunks of 448², and counts that are not a multiple of 16


def timed(fn: Callable[..., object], *args: torch.Tensor | float, n: int = 50) -> float:
    """Mean ms per call, after three calls of warm-up."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(*args)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n


def activation(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def main() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    o_w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * 0.02
    norm = torch.ones(HIDDEN, device=dev, dtype=dt)
    gate_up_w = torch.randn(2 * MLP, HIDDEN, device=dev, dtype=dt) * 0.02
    down_w = torch.randn(HIDDEN, MLP, device=dev, dtype=dt) * 0.02
    out: dict[str, object] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt)
        attended = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=dt)
        args = (x, attended, o_w, norm, gate_up_w, down_w, norm, 1e-6)
        ms = {"eager": timed(_output_and_mlp, *args)}
        for name, dynamic in (("dynamic", True), ("static", False)):
            torch._dynamo.reset()
            compiled = torch.compile(_output_and_mlp, dynamic=dynamic)
            _, code = run_and_get_code(compiled, *args)
            ms[name] = timed(compiled, *args)
            if tokens == TOKENS[0]:
                source = "\n".join(code)
                at = source.find("def triton_poi_fused_mul_silu")
                out[f"code_{name}"] = source[max(0, at - 400) : at + 1800]
        gate_up = torch.randn(tokens, 2 * MLP, device=dev, dtype=dt)
        for name, dynamic in (("act_dynamic", True), ("act_static", False)):
            torch._dynamo.reset()
            ms[name] = timed(torch.compile(activation, dynamic=dynamic), gate_up)
        ms["act_eager"] = timed(activation, gate_up)
        ms["act_bytes_GBps_dynamic"] = tokens * 3 * MLP * 2 / ms["act_dynamic"] / 1e6
        out[str(tokens)] = {k: round(v, 3) for k, v in ms.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
