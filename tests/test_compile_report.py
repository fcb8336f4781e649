"""The compile report's check (scripts/compile/report.py) fails closed, proved by feeding it broken reports;
and `default_config` never picks a configuration the committed report (docs/compile/report.json, written by
`bash scripts/compile_check.sh`) marks failing, on any of its targets: the GPU is faked by its compute
capability, the way `default_config` reads it from `jax.default_device`."""

import copy
import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from probjax_kernels import FlashConfig, _dispatch, default_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "compile"))
import fingerprints  # noqa: E402 - scripts/compile/fingerprints.py: what `_compile_key` reads
import report as compile_report  # noqa: E402 - scripts/compile/report.py: the check and its registry
import variants as registry  # noqa: E402

REPORT = json.loads((ROOT / "docs" / "compile" / "report.json").read_text())
TARGETS = REPORT["targets"]
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class FakeGPU:
    """What `default_config` reads of a device: its platform and compute capability."""

    compute_capability: str
    platform: str = "gpu"


def _gpu(target: str) -> FakeGPU:
    major, minor = re.fullmatch(r"sm_(\d)(\d)a?", REPORT["limits"][target]["arch"]).groups()
    return FakeGPU(f"{major}.{minor}")


def _tiles(config: FlashConfig) -> dict:
    return {k: v for k, v in vars(config).items() if k != "backend"}


def _failures(row: dict) -> list[str]:
    """What the report's own check (scripts/compile/report.py) found wrong with this compile."""
    return row["problems"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_reported_variant_is_the_default_and_passes(target, monkeypatch):
    """Each compiled variant's tiles are what default_config picks for that target, and none failed."""
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
    rows = [r for r in REPORT["rows"] if r["target"] == target and r["group"] in ("triton", "mosaic", "control")]
    assert rows
    for row in rows:
        head_dim = max(row["head_dim"], row["value_dim"] or 0)
        picked = default_config(FlashConfig(backend=row["backend"]), q_len=row["q_len"], kv_len=row["kv_len"],
                                head_dim=head_dim, dtype=DTYPES[row["dtype"]])
        assert _tiles(picked) == row["config"], row["variant"]
        assert not _failures(row), (row["variant"], _failures(row))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_on_the_seed_grid_are_reported_passing(target, head_dim, monkeypatch):
    """At every seed sequence length, default_config picks Triton tiles the report compiled without failing
    at that head dim (tiles do not depend on the length beyond shrinking to short sequences)."""
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
    passing = [r["config"] for r in REPORT["rows"] if r["target"] == target and r["head_dim"] == head_dim
               and r["group"] in ("triton", "control") and r["value_dim"] is None and not _failures(r)]
    assert passing
    for seq in (600, 1024, 1500, 2048, 3000, 4096, 8192):
        picked = _tiles(default_config(FlashConfig(backend="triton"), q_len=seq, kv_len=seq, head_dim=head_dim))
        assert picked in passing, (target, head_dim, seq, picked)


def test_target_device_follows_jax_default_device():
    """On the CPU the default device is the CPU, and default_config picks interpret mode's tiles."""
    with jax.default_device(jax.devices("cpu")[0]):
        assert _dispatch.target_device().platform == "cpu"
        assert default_config(None, q_len=1024, kv_len=1024, head_dim=128).backend == "interpret"


def test_tangent_tiles_shrink_the_key_tile_only_on_a_gpu(monkeypatch):
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu("sm86_rtx3090"))
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256)
    tangent = _dispatch.tangent_config(config, 256)
    assert (tangent.block_q, tangent.block_k, tangent.num_warps) == (32, 16, 8)
    assert _dispatch.tangent_config(config, 256, tables=True).block_q == config.block_q
    # The dtype as default_config takes it: float32 (FMA dots) shrinks the query tile at head dim 128 too.
    config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128)
    assert _dispatch.tangent_config(config, 128, dtype=jnp.float32).block_q == 16
    # with block tables too: the float32 flex tangent with a sliding window spilled 228 B at 32 x 16 on sm_90a
    f32 = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128, dtype=jnp.float32)
    assert _dispatch.tangent_config(f32, 128, tables=True, dtype=jnp.float32).block_q == 16 < f32.block_q
    # 16-bit: at most 64 on this 99 KB GPU (test_tangent_query_tile_fits_a_99_kb_gpu_at_head_dim_128).
    assert _dispatch.tangent_config(config, 128, dtype=jnp.bfloat16).block_q == min(config.block_q, 64)
    interpret = default_config(FlashConfig(backend="interpret"), q_len=1024, kv_len=1024, head_dim=256)
    assert _dispatch.tangent_config(interpret, 256) == interpret


# ------------------------------------------------------------------------------------- the check, fail-closed


def _kernel(name: str, target: str, dtype: str) -> dict:
    """A kernel row that passes every check: no spill, small shared memory, wgmma on Hopper, mma.sync and
    cp.async elsewhere, TMA in Mosaic kernels; float32 kernels use no tensor cores."""
    hopper = target == "sm90a_h100"
    mma = 0 if dtype == "f32" else 24
    return dict(kernel=name, lowering="mosaic" if name.startswith("probjax_mosaic") else "triton", registers=128,
                threads=256, smem=49_152, spill_stores=0, spill_loads=0, stack=0, HGMMA=mma if hopper else 0,
                HMMA=0 if hopper else mma, UTMALDG=8 if name.startswith("probjax_mosaic") else 0, LDGSTS=16)


def _clean_report() -> dict:
    """A report of every (target, variant) pair of the registry, each with exactly its required kernels."""
    rows = []
    for target, v in compile_report.expected():
        rows.append(dict(variant=v.name, group=v.group, target=target, head_dim=v.head_dim, value_dim=v.value_dim,
                         dtype=v.dtype, mode=v.mode, backend=v.backend, q_len=v.q_len, kv_len=v.kv_len,
                         status="ok", config={"num_stages": 2}, compile_s=1.0,
                         kernels=[_kernel(k, target, v.dtype) for k in v.requires]))
    return dict(targets=list(compile_report.TARGETS), rows=rows)


@pytest.fixture(scope="module")
def clean():
    return _clean_report()


def _row(report: dict, target: str, variant: str) -> dict:
    return next(r for r in report["rows"] if r["target"] == target and r["variant"] == variant)


def test_a_complete_clean_report_passes(clean):
    assert compile_report.problems(clean) == []


@pytest.mark.parametrize("drop", ["everything", "sm86_rtx3090", "decode", "mosaic"])
def test_missing_rows_fail(clean, drop):
    """An empty report, one without a target's rows or without a group's (decode, Mosaic) fails, naming each
    missing pair."""
    broken = dict(clean, rows=[r for r in clean["rows"] if drop != "everything" and drop not in (r["target"], r["group"])])
    found = compile_report.problems(broken)
    missing = {(r["target"], r["variant"]) for r in clean["rows"]} - {(r["target"], r["variant"]) for r in broken["rows"]}
    assert missing and len([p for p in found if "missing from the report" in p]) == len(missing)


def test_an_empty_expected_set_fails(clean):
    """--only matching nothing checks nothing: that fails instead of passing."""
    assert compile_report.problems(clean, only="^NOTHING$")
    assert compile_report.problems(clean, only="^flash_grad_d128_bf16_causal$") == []
    assert compile_report.problems(dict(clean, rows=[]), only="^flash_grad_d128_bf16_causal$")


@pytest.mark.parametrize("kernel", [registry.DKV, registry.DQ, registry.FORWARD])
def test_a_missing_kernel_fails(clean, kernel):
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm86_rtx3090", "flash_grad_d128_bf16_causal")
    row["kernels"] = [k for k in row["kernels"] if k["kernel"] != kernel]
    assert any("missing kernel" in p and kernel in p for p in compile_report.problems(broken))


def test_tangent_and_decode_kernels_are_required(clean):
    for target, variant, kernel in (("sm80_a100", "flash_jvp_d128_bf16_causal", registry.TANGENT),
                                    ("sm90a_h100", "decode_d128_bf16_cache8192_gqa8to2", registry.DECODE)):
        broken = copy.deepcopy(clean)
        row = _row(broken, target, variant)
        row["kernels"] = [k for k in row["kernels"] if k["kernel"] != kernel]
        assert any("missing kernel" in p and kernel in p for p in compile_report.problems(broken))


def test_a_variant_that_raised_while_built_fails(clean):
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm90a_h100", "decode_d64_bf16_cache8192_gqa8to2")
    row.update(status="error", error="ImportError: cannot import name 'DecodeConfig'", kernels=[])
    assert any("compile error" in p and "DecodeConfig" in p for p in compile_report.problems(broken))


def test_a_mosaic_variant_on_triton_kernels_fails(clean):
    """`_mosaic_takes` returning False puts a Mosaic call on the Triton kernels: the required probjax_mosaic_*
    kernels are missing and the Triton ones unexpected."""
    broken = copy.deepcopy(clean)
    row = _row(broken, "sm90a_h100", "mosaic_grad_d128_bf16_causal")
    row["kernels"] = [_kernel(k, "sm90a_h100", "bf16") for k in (registry.FORWARD, registry.DQ, registry.DKV)]
    found = " ".join(compile_report.problems(broken))
    assert registry.MOSAIC_FORWARD in found and "does not expect" in found


def test_a_row_the_registry_lacks_and_a_duplicate_fail(clean):
    broken = copy.deepcopy(clean)
    broken["rows"].append(dict(broken["rows"][0], variant="flash_grad_d96_bf16_full"))
    broken["rows"].append(copy.deepcopy(broken["rows"][1]))
    found = compile_report.problems(broken)
    assert any("not in the registry" in p for p in found) and any("twice" in p for p in found)


def test_spills_fail_outside_their_capped_entries(clean, monkeypatch):
    broken = copy.deepcopy(clean)
    kernel = _row(broken, "sm90a_h100", "flash_grad_d128_bf16_window")["kernels"][0]
    kernel.update(spill_stores=40, spill_loads=40)
    assert any("spills 40 B" in p for p in compile_report.problems(broken))
    # An entry is one kernel, on one target, in one variant: it covers nothing else, and caps its bytes.
    monkeypatch.setitem(compile_report.SPILLS, (kernel["kernel"], "sm90a_h100", "flash_grad_d128_bf16_window"),
                        (44, 44, "why"))
    assert compile_report.problems(broken) == []
    kernel.update(spill_stores=48)
    assert any("spills 48 B" in p for p in compile_report.problems(broken))
    kernel.update(spill_stores=40)
    _row(broken, "sm80_a100", "flash_grad_d128_bf16_window")["kernels"][0].update(spill_stores=8)
    assert any("sm80_a100" in p and "spills 8 B" in p for p in compile_report.problems(broken))


def test_shared_memory_over_the_target_fails(clean):
    broken = copy.deepcopy(clean)
    _row(broken, "sm86_rtx3090", "flash_grad_d128_bf16_full")["kernels"][2]["smem"] = 200_000
    assert any("shared memory over" in p for p in compile_report.problems(broken))


def test_hopper_kernels_must_be_mostly_wgmma(clean):
    """The sm_90a dK/dV at head dim 64 with most of its matmuls on mma.sync fails; a Mosaic kernel without
    TMA fails."""
    broken = copy.deepcopy(clean)
    dkv = next(k for k in _row(broken, "sm90a_h100", "flash_grad_d64_bf16_full")["kernels"]
               if k["kernel"] == registry.DKV)
    dkv.update(HGMMA=12, HMMA=96)
    assert any("wgmma share 0.11" in p for p in compile_report.problems(broken))
    dkv.update(HGMMA=96, HMMA=12)
    mosaic = _row(broken, "sm90a_h100", "mosaic_grad_d64_bf16_full")["kernels"][0]
    mosaic["UTMALDG"] = 0
    assert any("without TMA" in p for p in compile_report.problems(broken))


def test_ampere_kernels_use_mma_and_cp_async(clean):
    broken = copy.deepcopy(clean)
    kernel = _row(broken, "sm86_rtx3090", "flash_grad_d64_bf16_full")["kernels"][0]
    kernel.update(HMMA=0)
    assert any("without mma.sync" in p for p in compile_report.problems(broken))
    kernel.update(HMMA=24, LDGSTS=0)
    assert any("without cp.async" in p for p in compile_report.problems(broken))


def _mosaic_stdout(name: str, registers: int) -> str:
    """What Mosaic GPU prints on stdout for one kernel with its PTX, ptxas and SASS dumps on (dump.cc)."""
    return (f"//\n// Generated by LLVM NVPTX Back-End\n//\n.version 8.7\n.target sm_90a\n"
            f".visible .entry {name}_mosaic_gpu_kernel(\n\t.param .align 64 .b8 p[64]\n)\n.maxntid 384, 1, 1\n"
            f"{{\n\tret;\n}}\n"
            f"ptxas info    : Compiling entry function '{name}_mosaic_gpu_kernel' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {name}_mosaic_gpu_kernel\n"
            f"    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            f"ptxas info    : Used {registers} registers, used 16 barriers, 1 bytes smem\n\n"
            f"\t.headerflags\t@\"EF_CUDA_SM90\"\n.text.{name}_mosaic_gpu_kernel:\n"
            f"   -:-:-:-:01\tHGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n")


def test_mosaic_stdout_dumps_are_told_apart_by_kernel(tmp_path):
    """Mosaic GPU's dumps on stdout land in one file per kernel and dump kind, by the kernel's name in them;
    two kernels of one name in a compile (which stdout cannot tell apart) are an error, not a guess."""
    for stem, smem in (("probjax_mosaic_forward_4", 84992), ("probjax_mosaic_backward_dq_5", 100352)):
        (tmp_path / f"{stem}.resources.txt").write_text(f"Resources(smem_scratch_bytes={smem})\n")
    text = "noise\n" + _mosaic_stdout("probjax_mosaic_backward_dq", 200) + _mosaic_stdout("probjax_mosaic_forward", 168)
    compile_report._split_mosaic_stdout(text, tmp_path)
    forward = {kind: (tmp_path / f"probjax_mosaic_forward_4.{kind}").read_text() for kind in ("ptx", "ptxas", "sass_ctrl")}
    assert ".entry probjax_mosaic_forward_mosaic_gpu_kernel(" in forward["ptx"] and "ptxas" not in forward["ptx"]
    assert compile_report.parse_ptxas(forward["ptxas"])[0]["registers"] == 168
    assert compile_report.sass_counts(forward["sass_ctrl"])["HGMMA"] == 1
    assert compile_report.ptx_threads(forward["ptx"]) == 384
    dq = compile_report.parse_ptxas((tmp_path / "probjax_mosaic_backward_dq_5.ptxas").read_text())
    assert dq[0]["name"] == "probjax_mosaic_backward_dq_mosaic_gpu_kernel" and dq[0]["registers"] == 200
    (tmp_path / "probjax_mosaic_forward_6.resources.txt").write_text("Resources(smem_scratch_bytes=1)\n")
    (tmp_path / "probjax_mosaic_forward_7.resources.txt").write_text("Resources(smem_scratch_bytes=1)\n")
    with pytest.raises(ValueError, match="2 kernels named probjax_mosaic_forward"):
        compile_report._split_mosaic_stdout(_mosaic_stdout("probjax_mosaic_forward", 168), tmp_path)
    with pytest.raises(ValueError, match="without its PTX entry"):
        compile_report._split_mosaic_stdout("//\n// Generated by LLVM NVPTX Back-End\nno entry\n", tmp_path)


def test_a_calls_fwd_bwd_and_jvp_compile_as_one_unit():
    """The worker compiles a call's fwd+bwd variant and its jvp (same group, same call) as one program, and
    every other variant alone: each variant in exactly one unit."""
    variants = registry.variants()
    units = compile_report._compile_units(variants)
    assert sorted(v.name for unit in units for v in unit) == sorted(v.name for v in variants)
    pairs = [unit for unit in units if len(unit) == 2]
    assert all(g.mode == "fwd+bwd" and j.mode == "jvp" and g.group == j.group
               and g.name.replace("_grad_", "_jvp_", 1) == j.name for g, j in pairs)
    jvps = [v for v in variants if v.mode == "jvp"]
    grads = {v.name for v in variants if v.mode == "fwd+bwd"}
    assert len(pairs) == sum(v.name.replace("_jvp_", "_grad_", 1) in grads for v in jvps) > 100
    alone = compile_report._compile_units([v for v in variants if v.mode != "jvp"])
    assert all(len(unit) == 1 for unit in alone)


def test_a_joint_compile_gives_each_function_its_own_kernels():
    """In a joint compile's lowered module each variant's function is told its kernels through the functions it
    calls: Triton's by the custom call's name, Mosaic GPU's by the name in its serialized module; a forward both
    call counts for both; a function missing from the module is an error."""
    module = "\n".join([
        'module @jit__lambda {',
        '  func.func public @main(%arg0: tensor<4xbf16>) -> (tensor<4xbf16>) {',
        '    %0 = call @mosaic_grad_d128_bf16_full(%arg0) : (tensor<4xbf16>) -> tensor<4xbf16>',
        '    %1 = call @mosaic_jvp_d128_bf16_full(%arg0) : (tensor<4xbf16>) -> tensor<4xbf16>',
        '  }',
        '  func.func private @mosaic_grad_d128_bf16_full(%arg0: tensor<4xbf16>) -> tensor<4xbf16> {',
        '    %0 = call @mosaic_forward(%arg0) : (tensor<4xbf16>) -> tensor<4xbf16>',
        '    %1 = stablehlo.custom_call @mosaic_gpu_v2(%arg0) {mhlo.backend_config = {module = "ML\\EFR'
        '\\01probjax_mosaic_backward_dq\\00probjax_mosaic_backward_dq_mosaic_gpu\\00"}}',
        '  }',
        '  func.func private @mosaic_forward(%arg0: tensor<4xbf16>) -> tensor<4xbf16> {',
        '    %0 = call @_where(%arg0) : (tensor<4xbf16>) -> tensor<4xbf16>',
        '    %1 = stablehlo.custom_call @mosaic_gpu_v2(%arg0) {mhlo.backend_config = {module = "ML\\EFR'
        '\\01probjax_mosaic_forward_mosaic_gpu\\00"}}',
        '  }',
        '  func.func private @_where(%arg0: tensor<4xbf16>) -> tensor<4xbf16> {',
        '  }',
        '  func.func private @mosaic_jvp_d128_bf16_full(%arg0: tensor<4xbf16>) -> tensor<4xbf16> {',
        '    %0 = call @mosaic_forward(%arg0) : (tensor<4xbf16>) -> tensor<4xbf16>',
        '    %1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0, %0) {mhlo.backend_config = {grid_x = 8 : i32,'
        ' ir = "ML\\EFR name = \\22x\\22", name = "probjax_flash_tangent", num_stages = 2 : i32}}',
        '  }',
        '}'])
    grad, jvp = compile_report._kernels_by_function(
        module, ["mosaic_grad_d128_bf16_full", "mosaic_jvp_d128_bf16_full"])
    assert grad == {"probjax_mosaic_forward", "probjax_mosaic_backward_dq"}
    assert jvp == {"probjax_mosaic_forward", "probjax_flash_tangent"}
    with pytest.raises(ValueError, match="no function flash_jvp_d64_bf16_full"):
        compile_report._kernels_by_function(module, ["flash_jvp_d64_bf16_full"])


def _elf(sections: list[tuple[str, bytes]]) -> bytes:
    """A minimal ELF64 image holding `sections` (name, bytes) and its section-name table."""
    import struct

    names = b"\0" + b"".join(name.encode() + b"\0" for name, _ in sections) + b".shstrtab\0"
    body, placed = b"", []
    for _, data in sections:
        placed.append((64 + len(body), len(data)))
        body += data
    table_at = 64 + len(body) + len(names)
    headers = [bytes(64)]
    name_at = 1
    for (name, _), (at, size) in zip(sections, placed):
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 6, 0, at, size, 0, 0, 16, 0))
        name_at += len(name) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, 64 + len(body), len(names), 0, 0, 1, 0))
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<Q", header, 0x28, table_at)
    struct.pack_into("<HHH", header, 0x3A, 64, len(headers), len(headers) - 1)
    return bytes(header) + body + names + b"".join(headers)


def test_the_machine_code_of_a_cubin_is_its_text_sections():
    kernel, helper = bytes(range(32)), bytes(range(100, 116))
    image = _elf([(".text.probjax_flash_forward", kernel), (".nv.info", b"\x01" * 8), (".text.helper", helper)])
    assert compile_report.elf_code(image) == kernel + helper


def test_one_disassembly_is_split_back_by_instruction_offset(monkeypatch, tmp_path):
    """Kernels disassembled in one nvdisasm call get the instructions at their own offsets: 32 bytes (two
    16-byte instructions) for the first, none for an empty one, one for the last."""
    calls = []

    def fake_nvdisasm(command, **kwargs):
        calls.append(command)
        assert "--binary" in command and command[command.index("--binary") + 1] == "SM90a"
        listing = ("\t.headerflags\t@\"EF_CUDA_SM90\"\n"
                   "        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
                   "        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n"
                   "        /*0020*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;\n")
        return types.SimpleNamespace(stdout=listing)

    monkeypatch.setattr(compile_report.subprocess, "run", fake_nvdisasm)
    first, empty, last = compile_report._disassembled([bytes(32), b"", bytes(16)], "sm_90a", tmp_path)
    assert len(calls) == 1
    assert compile_report.sass_counts(first) == dict(HGMMA=1, HMMA=1, UTMALDG=0, LDGSTS=0)
    assert empty == "" and compile_report.sass_counts(last)["LDGSTS"] == 1


_TRITON_CALL = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a) {{mhlo.backend_config = {{ir = "ML\\EFR{root}'
                '/kernels/triton/forward.py\\00mul\\00{ir}", name = "probjax_flash_forward", num_stages = 2}}}}')
_MOSAIC_CALL = ('%1 = stablehlo.custom_call @mosaic_gpu_v2(%a) {{mhlo.backend_config = {{kernel_hash = "{hash}", '
                'module = "{toolchain}/peers/x.py\\00probjax_mosaic_forward_mosaic_gpu"}}}}')


def _module(root="/a/repo", toolchain="/srv/a/.cache/tc", ir="add", kernel_hash="\\CF\\FD\\22z") -> str:
    return "\n".join([_TRITON_CALL.format(root=root, ir=ir), _MOSAIC_CALL.format(hash=kernel_hash,
                                                                               toolchain=toolchain)])


def test_a_fingerprint_is_the_lowered_module_not_the_machine():
    """A compile's fingerprint is the same for the same lowered module in another checkout, toolchain folder or
    Mosaic `kernel_hash` (a hash of those paths), and new for one changed byte of a kernel's IR or another key
    (toolchain, target, figure code)."""
    key = "k" * 64
    first = compile_report._fingerprint(_module(), key, ("/a/repo", "/srv/a/.cache/tc"))
    moved = compile_report._fingerprint(_module("/b/clone", "/var/b/.cache/tc2", kernel_hash="\\00Q"), key,
                                        ("/b/clone", "/var/b/.cache/tc2"))
    assert first == moved
    assert compile_report._fingerprint(_module(ir="adf"), key, ("/a/repo", "/srv/a/.cache/tc")) != first
    assert compile_report._fingerprint(_module(), "j" * 64, ("/a/repo", "/srv/a/.cache/tc")) != first
    assert compile_report._fingerprint(_module(), key) != first  # the machine's folders are not left out


def test_a_tpu_kernels_encoded_module_is_read_without_the_machines_folders():
    """Mosaic TPU's module is base64 in the custom call's config: the folders are left out of it as well."""
    import base64

    def module(root: str, op: str = "mul") -> str:
        body = base64.b64encode(f"ML\xefR\x05{root}/kernels/tpu/forward.py\x00{op}".encode("latin-1")).decode()
        return f'custom_call @tpu_custom_call(%0) {{backend_config = "{{\\22custom_call_config\\22: {{\\22body\\22: \\22{body}\\22}}}}"}}'

    first = compile_report._fingerprint(module("/a/repo"), "k", ("/a/repo",))
    assert compile_report._fingerprint(module("/b/longer/clone"), "k", ("/b/longer/clone",)) == first
    assert compile_report._fingerprint(module("/a/repo", "add"), "k", ("/a/repo",)) != first


def test_source_file_names_lose_the_machines_folders():
    """The regex the workers give JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX strips the checkout, the toolchain
    and any site-packages from a kernel's source file names, and nothing else."""
    regex = compile_report.source_paths_regex(Path("/a/repo"), Path("/srv/x/.cache/tc"))
    assert re.sub(regex, "", "/a/repo/kernels/triton/forward.py") == "kernels/triton/forward.py"
    assert re.sub(regex, "", "/srv/x/.cache/tc/peers/tokamax/ops.py") == "peers/tokamax/ops.py"
    assert re.sub(regex, "", "/opt/v/lib/python3.12/site-packages/jax/_src/x.py") == "jax/_src/x.py"
    assert re.sub(regex, "", "/a/repository/x.py") == "/a/repository/x.py"


def test_the_compile_key_follows_toolchain_target_and_figure_code(tmp_path, monkeypatch):
    """`_compile_key` changes with the target, the toolchain's versions, its ptxas wrapper and the source of
    the code that reads the figures."""
    wrapper = tmp_path / "cuda_root" / "bin" / "ptxas"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/bin/sh\nexec ptxas.real -v \"$@\"\n")
    versions = dict(jax="0.11.2", ptxas="12.9.86")
    monkeypatch.setattr(fingerprints, "_versions", lambda toolchain: dict(versions))
    key = compile_report._compile_key("sm90a_h100", tmp_path)
    assert compile_report._compile_key("sm90a_h100", tmp_path) == key
    assert compile_report._compile_key("sm80_a100", tmp_path) != key
    versions["ptxas"] = "12.9.87"
    assert compile_report._compile_key("sm90a_h100", tmp_path) != key
    versions["ptxas"] = "12.9.86"
    wrapper.write_text("#!/bin/sh\nexec ptxas.real \"$@\"\n")
    assert compile_report._compile_key("sm90a_h100", tmp_path) != key
    wrapper.write_text("#!/bin/sh\nexec ptxas.real -v \"$@\"\n")
    monkeypatch.setattr(fingerprints, "FIGURE_CODE", fingerprints.FIGURE_CODE[1:])
    assert compile_report._compile_key("sm90a_h100", tmp_path) != key


def test_only_clean_fingerprinted_rows_of_the_target_are_reused():
    rows = [dict(target="sm90a_h100", variant="a", status="ok", fingerprint="f", kernels=[]),
            dict(target="sm90a_h100", variant="b", status="error", fingerprint="f", kernels=[]),
            dict(target="sm90a_h100", variant="c", status="ok", kernels=[]),
            dict(target="sm80_a100", variant="d", status="ok", fingerprint="f", kernels=[])]
    assert list(compile_report._reusable_rows(dict(rows=rows), "sm90a_h100")) == ["a"]


def test_the_units_compiled_again_are_picked_by_the_seed():
    """`--verify` picks that many units among those the earlier report holds whole, the same ones for one
    seed, others for another."""
    units = compile_report._compile_units(registry.variants())
    earlier = {v.name: {} for unit in units[:-5] for v in unit}
    picked = compile_report._verify_units(units, earlier, 3, "a")
    assert len(picked) == 3 and all(unit in units[:-5] for unit in picked)
    assert compile_report._verify_units(units, earlier, 3, "a") == picked
    assert any(compile_report._verify_units(units, earlier, 3, seed) != picked for seed in "bcd")
    assert compile_report._verify_units(units, {}, 3, "a") == []


def test_a_reused_figure_that_does_not_reproduce_fails(clean):
    """A unit compiled again whose module has the earlier row's fingerprint must give its figures: equal, it is
    marked reproduced; different, the row is an error the check fails; a changed module is a plain compile."""
    report = copy.deepcopy(clean)
    row = _row(report, "sm90a_h100", "flash_grad_d128_bf16_causal")
    row["fingerprint"] = "f"
    earlier = copy.deepcopy(row)
    assert compile_report._reproduces(row, earlier) == dict(reproduced=True)
    assert compile_report._reproduces(row, dict(earlier, fingerprint="g")) == {}
    assert compile_report._reproduces(row, None) == {}
    earlier["kernels"][0]["registers"] += 8
    row.update(compile_report._reproduces(row, earlier))
    assert row["status"] == "error" and not row["reproduced"]
    assert any("compile error: the same lowered module" in p for p in compile_report.problems(report))


def test_ci_reuses_the_committed_reports_unchanged_compiles():
    """CI's GPU compile takes the committed report's rows whose fingerprint is unchanged (every compiled row has
    one; a peer that fails to lower has none) and compiles the rest, and a sample of the reused ones again."""
    assert "--reuse docs/compile/report.json" in (ROOT / ".ci" / "run").read_text()
    assert all(r.get("fingerprint") for r in REPORT["rows"] if r["status"] == "ok")
    assert all(r.get("fingerprint") or r["group"] == "peer" for r in REPORT["rows"])


def test_check_cli_exit_status(clean, tmp_path):
    """`report.py check FILE` exits 1 on an empty report and 0 on a clean one."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(dict(clean, rows=[])))
    assert compile_report.check(path) == 1
    path.write_text(json.dumps(clean))
    assert compile_report.check(path) == 0


def test_the_registry_covers_the_dispatch_grid():
    """Each backend x dtype x head dim x mode, and each feature at every head dim, is a variant but for
    `NOT_YET_CLEAN`; a Mosaic call requires the Mosaic kernels exactly where the dispatch rules
    send it to them."""
    names = {v.name: v for v in registry.variants()}
    for prefix, backend in (("flash", "triton"), ("mosaic", "mosaic")):
        for dtype in ("bf16", "f32"):
            for d in (64, 128, 256):
                for mode, feature in (("grad", "full"), ("grad", "causal"), ("jvp", "causal")):
                    # backend "mosaic": jvp at head dim 128 (the tangent kernel's tiles are backend "triton"'s)
                    if backend == "triton" or mode == "grad" or d == 128:
                        assert f"{prefix}_{mode}_d{d}_{dtype}_{feature}" in names
            if backend == "mosaic" and dtype == "f32":
                continue  # falls back as a whole at backend "triton"'s float32 tiles (the test below)
            for hook in registry.FLEX_HOOKS:
                assert f"{prefix.replace('flash', '')}{'_' if backend == 'mosaic' else ''}flex_grad_d128_{dtype}_{hook}" \
                    in names
    # Every feature at every head dim in fwd+bwd and in jvp on both backends (16-bit on "mosaic"), but for the
    # calls still listed as not clean.
    features = ("full", "causal", "window", "gqa8to2_causal", "dv64", "dropout", "segments_lengths", "dense_bias",
                "dense_mask", *registry.FLEX_HOOKS)
    grid = {f"{prefix}{'flex' if feature in registry.FLEX_HOOKS else 'flash'}_{mode}_d{d}_{dtype}_{feature}"
            .replace("mosaic_flash", "mosaic")
            for prefix, dtypes in (("", ("bf16", "f32")), ("mosaic_", ("bf16",))) for dtype in dtypes
            for mode in ("grad", "jvp") for d in (64, 128, 256) for feature in features
            if not (feature == "dv64" and d == 64)}
    assert {"mosaic_jvp_d64_bf16_dropout", "mosaic_flex_jvp_d256_bf16_alibi", "flash_jvp_d64_f32_window"} <= grid
    assert grid - set(registry.NOT_YET_CLEAN) <= set(names)
    assert set(registry.NOT_YET_CLEAN) <= grid and not set(registry.NOT_YET_CLEAN) & set(names)
    assert len(registry.NOT_YET_CLEAN) < len(grid) // 4
    assert set(names["mosaic_grad_d128_bf16_causal"].requires) == {
        registry.MOSAIC_FORWARD, registry.MOSAIC_DQ, registry.MOSAIC_DKV}
    assert set(names["mosaic_grad_d256_bf16_causal"].requires) == {registry.MOSAIC_FORWARD, registry.DQ, registry.DKV}
    assert set(names["mosaic_grad_d128_f32_causal"].requires) == {registry.FORWARD, registry.DQ, registry.DKV}
    assert set(names["mosaic_flex_grad_d128_bf16_relative_bias"].requires) == {
        registry.FORWARD, registry.DQ, registry.DKV}
    assert names["mosaic_grad_d128_bf16_causal"].targets == registry.HOPPER
    assert any(name.startswith("decode_") for name in names)


def test_float32_on_the_mosaic_backend_keeps_the_float32_triton_tiles(monkeypatch):
    """float32 runs on the Triton kernels on backend "mosaic" too: it gets the float32 Triton tiles, not the
    Mosaic forward's 128 x 128 (which needed 262,144 B of shared memory on sm_90a's 232,448)."""
    monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu("sm90a_h100"))
    for head_dim in (64, 128, 256):
        mosaic, triton = (default_config(FlashConfig(backend=backend), q_len=1024, kv_len=1024, head_dim=head_dim,
                                         dtype=jnp.float32) for backend in ("mosaic", "triton"))
        assert _tiles(mosaic) == _tiles(triton)
    bf16 = default_config(FlashConfig(backend="mosaic"), q_len=1024, kv_len=1024, head_dim=128, dtype=jnp.bfloat16)
    assert (bf16.block_q, bf16.block_k) == (128, 128)


def test_tangent_splits_the_value_head_dim_where_256_spilled(monkeypatch):
    """Version 7d: at head dim 256 the 16-bit tangent on sm_90a splits the value head dim across two programs
    with block tables too (64 x 16, 4 warps); on sm_86 a bias tile or a gathered score tile (`score_tile`)
    splits it on the usual tiles, 16-bit and float32 (the unsplit float32 one needed 102,400 B); sm_80 and
    calls without them keep one program."""
    def tangent(target, dtype, **kwargs):
        monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256, dtype=dtype)
        tiles = _dispatch.tangent_config(config, 256, dtype=dtype, **kwargs)
        return config, tiles, _dispatch.tangent_value_splits(config, 256, dtype=dtype, **kwargs)

    _, tiles, splits = tangent("sm90a_h100", jnp.bfloat16, tables=True)
    assert (tiles.block_q, tiles.block_k, tiles.num_warps, splits) == (64, 16, 4, 2)
    assert tangent("sm90a_h100", jnp.float32, tables=True)[2] == 1
    for dtype in (jnp.bfloat16, jnp.float32):
        plain = tangent("sm86_rtx3090", dtype)
        config, tiles, splits = tangent("sm86_rtx3090", dtype, score_tile=True)
        assert (tiles, splits, plain[2]) == (plain[1], 2, 1)
        assert tangent("sm80_a100", dtype, score_tile=True)[2] == 1


def test_tangent_takes_two_stages_at_head_dim_256_on_a_99_kb_gpu(monkeypatch):
    """Version 7e: the 16-bit tangent at head dim 256 on sm_86 (32 x 16 on 1 stage by default there) spilled
    8-12 B with a window or ALiBi; it takes 2 stages without block tables (whose 64 x 16 tile would not fit
    twice), sm_80 keeps `default_config`'s stage."""
    for target, tables, stages in (("sm86_rtx3090", False, 2), ("sm86_rtx3090", True, 1), ("sm80_a100", False, 1)):
        monkeypatch.setattr(_dispatch, "target_device", lambda target=target: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=256)
        assert config.num_stages == 1
        tiles = _dispatch.tangent_config(config, 256, tables, dtype=jnp.bfloat16)
        assert (tiles.block_k, tiles.num_stages) == (16, stages)


def test_tangent_query_tile_fits_a_99_kb_gpu_at_head_dim_128(monkeypatch):
    """sm_86: the tangent's 128 x 32 tile with a relative-bias table needed 114,688 B of shared memory (101,376
    available): the query tile is 64 there without block tables; sm_90a keeps 128."""
    for target, block_q in (("sm86_rtx3090", 64), ("sm90a_h100", 128)):
        monkeypatch.setattr(_dispatch, "target_device", lambda target=target: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=128)
        tangent = _dispatch.tangent_config(config, 128)
        assert (tangent.block_q, tangent.block_k) == (block_q, 32)
        assert _dispatch.tangent_config(config, 128, tables=True).block_q == config.block_q


def test_a_gathered_score_tile_narrows_the_forward_key_tile_without_wgmma(monkeypatch):
    """A score_mod that gathers a value per score from a captured table (relative bias) spilled 40-56 B in the
    16-bit Triton forward at 128 x 64 on sm_80 / sm_86: the forward takes 128 x 32 there. sm_90a (wgmma,
    no spill), a per-head scalar read (ALiBi), float32 and head dim 64 keep their tiles."""
    from probjax_kernels import alibi, alibi_slopes, relative_bias
    from probjax_kernels._hooks import trace_score_mod
    from probjax_kernels._problem import Features, _Problem

    def forward_tiles(target, score_mod, dtype=jnp.bfloat16, head_dim=128):
        monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        hook, consts = trace_score_mod(score_mod)
        for _, _, rows, cols, score in _dispatch.hook_shapes(config):
            hook.prepare(*(jax.ShapeDtypeStruct(s, t) for s, t in (
                (score, jnp.float32), ((), jnp.int32), ((), jnp.int32), (rows, jnp.int32), (cols, jnp.int32))))
        problem = _Problem(Features(scale=1.0, score_mod=hook), 1, 8, None, None, None, False, len(consts), 0,
                           config, jax.lax.Precision.DEFAULT)
        picked = _dispatch.triton_forward_config(problem, config, dtype, head_dim)
        return (config.block_q, config.block_k), (picked.block_q, picked.block_k)

    table = relative_bias(jnp.zeros((8, 2047), jnp.float32))
    for target in ("sm80_a100", "sm86_rtx3090"):
        assert forward_tiles(target, table) == ((128, 64), (128, 32))
        assert forward_tiles(target, alibi(alibi_slopes(8))) == ((128, 64), (128, 64))
        default, picked = forward_tiles(target, table, dtype=jnp.float32)
        assert default == picked
        default, picked = forward_tiles(target, table, head_dim=64)
        assert default == picked
    assert forward_tiles("sm90a_h100", table) == ((128, 64), (128, 64))


def test_float32_kernels_are_retiled_where_features_spilled(monkeypatch):
    """float32 at head dim 128 (FMA dots) on sm_80 / sm_86: the forward with a window or dropout takes 3
    stages (12 B), dQ 4 warps (the default tiles spilled 4-20 B with a window, dropout, ALiBi or a BlockMask);
    on sm_90a dQ takes 3 stages (4-32 B with a dense mask or a BlockMask; 4 warps spilled 676 B with a soft
    cap on a BlockMask). dK/dV keeps its tiles (with GQA it runs per query head). 16-bit inputs keep their
    tiles. At head dim 64 and 256 (Versions 7c, 7d) the float32 rules of `triton.retile._float32_local`."""
    from probjax_kernels._problem import Features, _Problem

    def configs(target, group, dtype=jnp.float32, head_dim=128, tables=False, window=None):
        monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        features = Features(scale=1.0, window_left=window, block_sizes=(128, 128) if tables else None)
        problem = _Problem(features, group, 8, None, None, None, False, 0, 0, config, jax.lax.Precision.HIGHEST)
        forward = _dispatch.triton_forward_config(problem, config, dtype, head_dim)
        return config, forward, *_dispatch.triton_backward_configs(problem, dtype, head_dim)

    for target in TARGETS:
        hopper = target == "sm90a_h100"
        config, forward, dq, dkv = configs(target, group=4)
        assert forward == config
        windowed = configs(target, 4, window=256)[1]
        assert windowed == (config if hopper else dataclasses.replace(config, num_stages=3))
        assert dq == dataclasses.replace(config, **({"num_stages": 3} if hopper else {"num_warps": 4}))
        assert dkv == config
        assert configs(target, group=1)[3] == config
        assert configs(target, 1, tables=True)[2] == dq
        kept = configs(target, 1, dtype=jnp.bfloat16, window=256)
        assert all(c == kept[0] for c in kept[1:])
        # Version 7c: float32 at head dim 64 with a window or a BlockMask, forward and dK/dV on 3 stages; at 256
        # with a window, 4 warps in every kernel. Version 7d: a BlockMask's dQ on 16-key steps at 64 on sm_80 /
        # sm_86; at 256 a BlockMask's forward and dK/dV on 4 warps, its dQ on 2.
        config, forward, dq, dkv = configs(target, 1, head_dim=64, window=256)
        assert forward == dkv == dataclasses.replace(config, num_stages=3) and dq == config
        config, forward, dq, dkv = configs(target, 1, head_dim=64, tables=True)
        assert forward == dkv == dataclasses.replace(config, num_stages=3)
        assert config.block_k_dq == 32 and dq == (config if hopper else dataclasses.replace(config, block_k_dq=16))
        config, *kernels = configs(target, 1, head_dim=256, window=256)
        assert kernels == [dataclasses.replace(config, num_warps=4)] * 3
        config, forward, dq, dkv = configs(target, 1, head_dim=256, tables=True)
        assert forward == dkv == dataclasses.replace(config, num_warps=4)
        assert dq == dataclasses.replace(config, num_warps=2)


def test_dk_and_dv_run_in_two_programs_at_head_dim_256_with_a_score_tile(monkeypatch):
    """Version 7f: on sm_90a at head dim 256 (16-bit, K Q^T), a dense bias or a score_mod gathering a score tile
    (a relative-bias table) runs dV and dK in two programs per key tile, on 32-query steps (the one-program
    kernel spilled 8 B with a float32 tile on 16); without one, at head dim 128, in float32 (Q K^T) and on
    sm_80 / sm_86, one program on the usual tiles."""
    from probjax_kernels import alibi, alibi_slopes, relative_bias
    from probjax_kernels._hooks import trace_score_mod
    from probjax_kernels._problem import Features, _Problem

    def dkv(target, head_dim=256, dtype=jnp.bfloat16, bias=None, score_mod=None):
        monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        transposed = _dispatch.triton_dkv_transposed(config, dtype, head_dim, bias is not None)
        hook = num_consts = None
        if score_mod is not None:
            hook, consts = trace_score_mod(score_mod)
            num_consts = len(consts)
            for _, _, rows, cols, score in _dispatch.hook_shapes(config, transposed):
                hook.prepare(*(jax.ShapeDtypeStruct(s, t) for s, t in (
                    (score, jnp.float32), ((), jnp.int32), ((), jnp.int32), (rows, jnp.int32), (cols, jnp.int32))))
        problem = _Problem(Features(scale=1.0, score_mod=hook), 1, 8, bias, None, None, False, num_consts or 0, 0,
                           config, jax.lax.Precision.DEFAULT, dkv_transposed=transposed)
        dkv_config = _dispatch.triton_backward_configs(problem, dtype, head_dim)[1]
        return config, dkv_config, _dispatch.triton_dkv_split(problem, head_dim)

    bias, table = (4, 8, 1024, 1024), relative_bias(jnp.zeros((8, 2047), jnp.float32))
    for kwargs in (dict(bias=bias), dict(bias=(1, 8, 1, 1024)), dict(score_mod=table)):
        config, dkv_config, split = dkv("sm90a_h100", **kwargs)
        assert split and (config.block_q_dkv, config.block_k_dkv) == (16, 64)
        assert dkv_config == dataclasses.replace(config, block_q_dkv=32)
    for target, kwargs in (("sm90a_h100", {}), ("sm90a_h100", dict(score_mod=alibi(alibi_slopes(8)))),
                           ("sm90a_h100", dict(head_dim=128, score_mod=table)),
                           ("sm90a_h100", dict(dtype=jnp.float32, bias=bias)),
                           ("sm80_a100", dict(bias=bias)), ("sm86_rtx3090", dict(score_mod=table))):
        config, dkv_config, split = dkv(target, **kwargs)
        assert not split and dkv_config.block_q_dkv <= config.block_q_dkv, (target, kwargs)  # never wider


def test_a_dense_bias_or_mask_retiles_the_kernels_that_spilled_with_it(monkeypatch):
    """A bias or mask tile (Version 7b): at head dim 64 the 16-bit forward takes 8 warps on every GPU and, with
    a bias, dK/dV 32-query steps on sm_80 / sm_86; at head dim 256 a bias takes 16-query dK/dV steps on sm_86
    (shared memory) and K Q^T on sm_90a (Q K^T at 128); float32 at 256 with a mask, dK/dV on 4 warps on sm_80
    / sm_86. With GQA, dK/dV runs per query head whatever the call, on the bias's dK/dV steps on sm_80 / sm_86
    (16-bit) and on 4 warps at head dim 64 / 256 on sm_90a (float32). Dropout and a window at head dim 64 as
    a bias there (Version 7c). A BlockMask at 64 on sm_80 / sm_86: 32-key dK/dV tiles (Version 7d). Calls
    without them keep `default_config`'s tiles."""
    from probjax_kernels._problem import Features, _Problem

    def configs(target, head_dim, dtype=jnp.bfloat16, bias=None, mask=None, group=1, **features):
        monkeypatch.setattr(_dispatch, "target_device", lambda: _gpu(target))
        config = default_config(FlashConfig(backend="triton"), q_len=1024, kv_len=1024, head_dim=head_dim,
                                dtype=dtype)
        problem = _Problem(Features(scale=1.0, **features), group, 8, bias, mask, None, False, 0, 0, config,
                           jax.lax.Precision.DEFAULT)
        forward = _dispatch.triton_forward_config(problem, config, dtype, head_dim)
        transposed = _dispatch.triton_dkv_transposed(config, dtype, head_dim, bias is not None)
        return (config, forward, *_dispatch.triton_backward_configs(problem, dtype, head_dim), transposed,
                _dispatch.triton_dkv_per_query_head(problem))

    tile, keys = (4, 8, 1024, 1024), (4, 1, 1, 1024)
    for target in TARGETS:
        hopper, small = target == "sm90a_h100", target == "sm86_rtx3090"
        for head_dim in (64, 128, 256):
            config, forward, dq, dkv, transposed, per_head = configs(target, head_dim)
            assert forward == dq == dkv == config and not per_head
            assert transposed == (hopper and head_dim > 64)
        config, forward, dq, dkv, _, _ = configs(target, 64, bias=tile)
        assert forward == dataclasses.replace(config, num_warps=8) and dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        assert configs(target, 64, mask=(4, 1, 1024, 1024))[1].num_warps == 8
        assert configs(target, 128, bias=tile)[4] is False
        config, _, _, dkv, transposed, _ = configs(target, 256, bias=tile)
        assert transposed == hopper
        assert dkv == (dataclasses.replace(config, block_q_dkv=16) if small else config)
        config, _, _, dkv, _, _ = configs(target, 256, jnp.float32, mask=tile)
        assert dkv == (config if hopper else dataclasses.replace(config, num_warps=4))
        assert configs(target, 128, group=4)[5] and configs(target, 128, mask=keys, group=4)[5]
        assert not configs(target, 128, bias=tile)[5]
        # GQA (its dK / dV per query head, written in float32): the bias's dK/dV steps on sm_80 / sm_86, float32
        # dK/dV on 4 warps at head dim 64 / 256 on sm_90a.
        config, _, _, dkv, _, _ = configs(target, 64, group=4)
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        config, _, _, dkv, _, _ = configs(target, 256, group=4)
        assert dkv == (dataclasses.replace(config, block_q_dkv=16) if small else config)
        for head_dim in (64, 256):
            config, _, _, dkv, _, _ = configs(target, head_dim, jnp.float32, group=4)
            assert dkv == (dataclasses.replace(config, num_warps=4) if hopper else config)
        assert configs(target, 128, jnp.float32, group=4)[3].num_warps == 8
        # Version 7c, 16-bit at head dim 64: dropout's forward on 8 warps too, a window's dK/dV on the bias's
        # 32-query steps on sm_80 / sm_86.
        config, forward, dq, dkv, _, _ = configs(target, 64, dropout_rate=0.1)
        assert forward == dataclasses.replace(config, num_warps=8) and dq == dkv == config
        config, forward, dq, dkv, _, _ = configs(target, 64, window_left=256, window_right=0)
        assert forward == dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_q_dkv=32))
        assert configs(target, 128, window_left=256, window_right=0)[3] == configs(target, 128)[0]
        # Version 7d, 16-bit at head dim 64 with a BlockMask: dK/dV on 32-key tiles on sm_80 / sm_86.
        config, forward, dq, dkv, _, _ = configs(target, 64, block_sizes=(128, 128))
        assert forward == dq == config
        assert dkv == (config if hopper else dataclasses.replace(config, block_k_dkv=32))
        assert configs(target, 128, block_sizes=(128, 128))[3] == configs(target, 128)[0]
