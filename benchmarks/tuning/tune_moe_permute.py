"""Check and time the MoE permute kernels on a GPU.

Run from the repository root: ``PYTHONPATH=. python
benchmarks/tuning/tune_moe_permute.py [--sweep] [--out DIR]``.
Correctness at full sizes against the PyTorch references first, then times
under CUDA-graph replay (many iterations captured in one graph) and a
device-to-device copy for the bandwidth ceiling. ``--sweep`` and
``--sweep-rows`` also time the launch-configuration candidates of the sort and
of the row kernels.
"""

import argparse
import itertools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from vllm.benchmarks.utils import copy_bandwidth_gbps, time_graph_us
from vllm.model_executor.kernels.moe_permute import reference as mp_ref
from vllm.model_executor.kernels.moe_permute import rows as mp_rows
from vllm.model_executor.kernels.moe_permute import sort as mp_sort

TOPK = 8
DEV = torch.device("cuda")
LOG: list[str] = []
OUT_FILE: Path | None = None


def emit(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)
    if OUT_FILE is not None:
        OUT_FILE.write_text("\n".join(LOG) + "\n")


def graph_us(fn: Callable[[], None], iters: int, reps: int = 7) -> float:
    """Median microseconds per call of ``fn`` over replays of a graph that
    holds ``iters`` calls."""
    return time_graph_us(lambda _: fn(), iters, reps)


def iters_for(nbytes: float) -> int:
    # About 3 ms of work per replay, at least 2 and at most 200 calls.
    return max(2, min(200, int(3e-3 / max(nbytes / 3.5e12, 2e-6))))


class Case:
    """Static buffers of one (T, H, E, EP) problem."""

    def __init__(
        self,
        num_tokens: int,
        hidden: int,
        n_expert: int,
        ep_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        invalid_fraction: float = 0.0,
        groups: int = 0,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.T, self.H, self.E = num_tokens, hidden, n_expert
        self.n_local = n_expert // ep_size
        self.R = num_tokens * TOPK
        self.expert_map: torch.Tensor | None = None
        if ep_size > 1:
            emap = torch.full((n_expert,), -1, dtype=torch.int32, device=DEV)
            chosen = torch.randperm(n_expert, device=DEV)[: self.n_local]
            emap[chosen] = torch.randperm(self.n_local, device=DEV).int()
            self.expert_map = emap
        self.topk_ids = torch.empty(num_tokens, TOPK, dtype=torch.int32, device=DEV)
        self.new_ids(invalid_fraction)
        self.x = (torch.randn(num_tokens, hidden, device=DEV) * 2).to(dtype)
        self.scale = (
            torch.rand(num_tokens, groups, device=DEV) + 0.1 if groups else None
        )
        self.inv = torch.empty(self.R, dtype=torch.int32, device=DEV)
        self.perm = torch.empty(self.R, dtype=torch.int32, device=DEV)
        self.offsets = torch.empty(self.n_local + 1, dtype=torch.int64, device=DEV)
        # Generous, so that every candidate sort block fits.
        sort_numel = max(
            mp_sort.sort_workspace_numel(self.R, self.n_local),
            triton.cdiv(self.R, 64) * mp_sort._num_count_columns(self.n_local),
        )
        self.sort_workspace = torch.empty(sort_numel, dtype=torch.int32, device=DEV)
        self.out = torch.empty(self.R, hidden, dtype=dtype, device=DEV)
        self.out_scale = torch.empty(self.R, groups, device=DEV) if groups else None
        self.w = torch.rand(num_tokens, TOPK, device=DEV)
        self.y = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=DEV)

    def new_ids(self, invalid_fraction: float) -> None:
        ids = torch.rand(self.T, self.E, device=DEV).topk(TOPK, dim=1).indices
        bad = torch.rand(self.T, TOPK, device=DEV) < invalid_fraction
        bad_ids = torch.tensor([-1, self.E, self.E + 9], device=DEV)[
            torch.randint(0, 3, (self.T, TOPK), device=DEV)
        ]
        self.topk_ids.copy_(torch.where(bad, bad_ids, ids))

    def sort(self) -> None:
        mp_sort.route_sort(
            self.topk_ids,
            self.expert_map,
            self.E,
            self.n_local,
            self.inv,
            self.perm,
            self.offsets,
            self.sort_workspace,
        )

    def permute(self) -> None:
        mp_rows.permute_rows(
            self.x, self.inv, TOPK, self.offsets, self.out, self.scale, self.out_scale
        )

    def unpermute(self) -> None:
        mp_rows.unpermute_rows(self.y, self.out, self.w, self.inv, self.offsets)

    def row_bytes(self) -> int:
        return self.H * self.x.element_size()

    def permute_bytes(self) -> int:
        # Token rows read once, valid rows written, plus the index traffic.
        return self.T * self.row_bytes() + self.R * self.row_bytes() + self.R * 16

    def unpermute_bytes(self) -> int:
        return (self.R + self.T) * self.H * 2 + self.R * 8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(mp_rows._SAME_SIZE_INT[t.element_size()])


def check_case(case: Case, rows: bool) -> list[str]:
    errors = []
    case.inv.fill_(-7)
    case.perm.fill_(-7)
    case.offsets.fill_(-7)
    case.sort_workspace.fill_(-7)
    case.sort()
    ref_inv, ref_perm, ref_offsets = mp_ref.route_sort_reference(
        case.topk_ids, case.expert_map, case.E, case.n_local
    )
    tag = f"T={case.T} E={case.E} local={case.n_local}"
    if not torch.equal(case.offsets, ref_offsets):
        errors.append(f"offsets {tag}")
    if not torch.equal(case.inv, ref_inv) or not torch.equal(case.perm, ref_perm):
        errors.append(f"sort {tag}")
    if not rows:
        return errors
    case.out.view(torch.uint8).fill_(0x7F)
    if case.out_scale is not None:
        case.out_scale.fill_(float("nan"))
    case.permute()
    ref_rows, ref_scale = mp_ref.permute_rows_reference(
        case.x, ref_inv, TOPK, ref_offsets, case.scale
    )
    nv = int(ref_offsets[-1])
    if not torch.equal(bits(case.out[:nv]), bits(ref_rows[:nv])):
        errors.append(f"permute {tag} H={case.H} {case.x.dtype}")
    if not (case.out[nv:].view(torch.uint8) == 0x7F).all():
        errors.append(f"permute wrote invalid rows {tag}")
    if (
        ref_scale is not None
        and case.out_scale is not None
        and not torch.equal(case.out_scale[:nv], ref_scale[:nv])
    ):
        errors.append(f"permute scale {tag}")
    if case.x.dtype == torch.bfloat16:
        case.y.fill_(float("nan"))
        case.unpermute()
        ref_y = mp_ref.unpermute_rows_reference(case.out, case.w, ref_inv, ref_offsets)
        if not torch.allclose(case.y.float(), ref_y.float(), rtol=8e-3, atol=8e-3):
            diff = (case.y.float() - ref_y.float()).abs().max().item()
            errors.append(f"unpermute {tag} H={case.H} maxdiff={diff}")
    return errors


def run_checks() -> None:
    errors: list[str] = []
    count = 0
    for num_tokens, n_expert, ep in itertools.product(
        [1, 33, 1024, 5000, 16384], [16, 64, 256], [1, 4]
    ):
        case = Case(num_tokens, 16, n_expert, ep, invalid_fraction=0.05)
        errors += check_case(case, rows=False)
        count += 1
        # Every candidate block of the two-launch sort.
        if case.R > 2048:
            for block in (256, 512, 1024, 2048):
                case.inv.fill_(-7)
                case.perm.fill_(-7)
                mp_sort._route_sort_blocked(
                    case.topk_ids,
                    case.expert_map,
                    case.E,
                    case.n_local,
                    case.inv,
                    case.perm,
                    case.offsets,
                    case.sort_workspace,
                    block,
                )
                ref = mp_ref.route_sort_reference(
                    case.topk_ids, case.expert_map, case.E, case.n_local
                )
                if not (
                    torch.equal(case.inv, ref[0]) and torch.equal(case.offsets, ref[2])
                ):
                    errors.append(f"blocked sort block={block} T={num_tokens}")
                count += 1
    for num_tokens, hidden, ep in itertools.product(
        [1, 33, 1024, 5000, 16384], [2048, 7168], [1, 4]
    ):
        case = Case(
            num_tokens, hidden, 256, ep, invalid_fraction=0.05, groups=hidden // 128
        )
        errors += check_case(case, rows=True)
        count += 1
        del case
    for num_tokens in (1, 33, 5000):
        case = Case(num_tokens, 7168, 256, 4, torch.float8_e4m3fn, 0.05, 56)
        errors += check_case(case, rows=True)
        count += 1
    torch.cuda.empty_cache()
    emit(f"CHECK {'FAIL' if errors else 'ok'}: {count} cases; {errors[:8]}")


def copy_tbps() -> float:
    tbps = copy_bandwidth_gbps(DEV) / 1e3
    emit(f"COPY 1GiB d2d: {tbps:.3f} TB/s (read+write)")
    return tbps


def count_only(case: Case, block: int) -> Callable[[], None]:
    """The first of the two sort launches alone."""
    return lambda: mp_sort._route_count_kernel[(triton.cdiv(case.R, block),)](
        case.topk_ids, case.topk_ids, case.sort_workspace, case.R, case.E, case.n_local,
        HAS_MAP=False, BLOCK=block,
        NUM_BUCKETS=mp_sort._num_buckets_padded(case.n_local),
        NUM_COLS=mp_sort._num_count_columns(case.n_local), num_warps=4,
    )  # fmt: skip


def sweep_sort() -> None:
    emit("SORT sweep (E=256, us): path/block/warps; count = first launch alone")
    for num_tokens in (1, 4, 33, 64, 128):
        case = Case(num_tokens, 16, 256)
        line = []
        for warps in (1, 2, 4):

            def single(c: Case = case, w: int = warps) -> None:
                mp_sort._route_sort_single(
                    c.topk_ids, None, c.E, c.n_local, c.inv, c.perm, c.offsets, w
                )

            line.append(f"w{warps}={graph_us(single, 100):.2f}")
        emit(f"  single T={num_tokens} R={case.R}: " + " ".join(line))
    for num_tokens in (65, 128, 1024, 4096, 16384):
        case = Case(num_tokens, 16, 256)
        line = [f"default={graph_us(case.sort, 50):.2f}"]
        for block, warps in itertools.product((256, 512, 1024, 2048), (4, 8)):
            nblocks = triton.cdiv(case.R, block)
            if nblocks < 2 or nblocks > 1024:
                continue

            def blocked(c: Case = case, b: int = block, w: int = warps) -> None:
                mp_sort._route_sort_blocked(
                    c.topk_ids, None, c.E, c.n_local, c.inv, c.perm, c.offsets,
                    c.sort_workspace, b, w,
                )  # fmt: skip

            line.append(f"b{block}w{warps}={graph_us(blocked, 50):.2f}")
            if warps == 4:
                count_us = graph_us(count_only(case, block), 50)
                line.append(f"(count {count_us:.2f})")
        emit(f"  blocked T={num_tokens} R={case.R}: " + " ".join(line))


def row_op(case: Case, name: str, tile: int, warps: int) -> Callable[[], None]:
    if name == "permute":
        return lambda: mp_rows._permute_rows_launch(
            case.x, case.inv, TOPK, case.offsets, case.out, None, None, tile, warps
        )
    return lambda: mp_rows._unpermute_rows_launch(
        case.y, case.out, case.w, case.inv, case.offsets, tile, warps
    )


def sweep_rows() -> None:
    emit("ROWS sweep (bf16, E=256): tile bytes/warps -> us (TB/s)")
    configs = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]
    for num_tokens, hidden in ((1024, 2048), (4096, 7168)):
        case = Case(num_tokens, hidden, 256)
        case.sort()
        for name, nbytes in (
            ("permute", case.permute_bytes()),
            ("unpermute", case.unpermute_bytes()),
        ):
            line = []
            for tile, warps in configs:
                us = graph_us(row_op(case, name, tile, warps), iters_for(nbytes), 5)
                line.append(f"{tile}/{warps}={us:.1f}({nbytes / us / 1e6:.2f})")
            emit(f"  {name} T={num_tokens} H={hidden}: " + " ".join(line))
        del case
        torch.cuda.empty_cache()


def final_table(copy_bw: float) -> None:
    rows = []
    for num_tokens, hidden in itertools.product(
        (1, 33, 1024, 4096, 16384), (2048, 7168)
    ):
        case = Case(num_tokens, hidden, 256)
        pb, ub = case.permute_bytes(), case.unpermute_bytes()
        it = iters_for(pb)
        sort_us = graph_us(case.sort, it)
        rows_us = graph_us(case.permute, it)

        def sort_permute(c: Case = case) -> None:
            c.sort()
            c.permute()

        perm_us = graph_us(sort_permute, it)
        unperm_us = graph_us(case.unpermute, iters_for(ub))

        def all_three(c: Case = case) -> None:
            c.sort()
            c.permute()
            c.unpermute()

        all_us = graph_us(all_three, iters_for(pb + ub))
        perm_tb = pb / perm_us / 1e6
        unperm_tb = ub / unperm_us / 1e6
        rows.append(
            f"{num_tokens:>6} {hidden:>5} {sort_us:7.2f} {rows_us:8.2f} "
            f"{perm_us:8.2f} {perm_tb:5.2f} {perm_tb / copy_bw:5.2f} "
            f"{unperm_us:8.2f} {unperm_tb:5.2f} {unperm_tb / copy_bw:5.2f} "
            f"{all_us:8.2f}"
        )
        del case
        torch.cuda.empty_cache()
    emit(
        "FINAL (bf16, topk 8, E=256, no map; us under graph replay; TB/s on unique"
        " bytes; frac = of copy)"
    )
    emit(
        "     T     H    sort permrows sort+prm  TB/s  frac   unperm  TB/s  frac"
        "    all3"
    )
    for row in rows:
        emit(row)


def main() -> None:
    global OUT_FILE
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="sort launch configs")
    parser.add_argument("--sweep-rows", action="store_true", help="row tile configs")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        OUT_FILE = args.out / "moe_permute_results.txt"
    emit(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
         f"triton {triton.__version__}")  # fmt: skip
    steps: list[Callable[[], None]] = []
    if not args.skip_checks:
        steps.append(run_checks)
    copy_bw = copy_tbps()
    steps.append(lambda: final_table(copy_bw))
    if args.sweep:
        steps.append(sweep_sort)
    if args.sweep_rows:
        steps.append(sweep_rows)
    for step in steps:
        try:
            step()
        except Exception:
            emit("ERROR " + traceback.format_exc()[-1500:])
    sys.exit(0)


if __name__ == "__main__":
    main()
