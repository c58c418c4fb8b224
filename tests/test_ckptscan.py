"""The torch-free checkpoint scan (agent/trainer/ckptscan.py) against the real ``torch.save``
and ``torch.isfinite``: every floating type torch saves (typed storages and the
``UntypedStorage`` + dtype form of ``_rebuild_tensor_v3``), NaN and inf at random places, shared
storages, parameters, whole pickled modules; and files that must not be trusted: a pickle that
names ``os.system``, a big-endian archive, a type the scan does not know, a torn member."""

from __future__ import annotations

import math
import pickle
import random
import threading
import zipfile
from pathlib import Path

import pytest

from agent.trainer import ckptscan
from agent.trainer.ckptscan import Cancelled, ScanError, nonfinite_in, scan

torch = pytest.importorskip("torch")

FLOATS = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
#: No inf in these: an inf written to them becomes NaN (or saturates), so NaN is planted.
NO_INF = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def finite(t: torch.Tensor) -> bool:
    if t.dtype in (torch.float8_e5m2, *NO_INF):
        t = t.float()  # torch has no isfinite for float8
    return bool(torch.isfinite(t).all())


def test_every_floating_type_agrees_with_torch_isfinite(tmp_path: Path) -> None:
    rng = random.Random(20261204)
    torch.manual_seed(7)
    path = tmp_path / "c.pt"
    for _ in range(60):
        parts: dict[str, torch.Tensor] = {}
        for i, dtype in enumerate(FLOATS):
            n = rng.randint(1, 300)
            scale = rng.choice([1.0, 1e3, 6e4, 1e30])
            if dtype.is_complex:
                t = torch.randn(n, dtype=dtype) * scale
            else:
                t = (torch.randn(n) * scale).to(dtype)
            if rng.random() < 0.35:
                value = rng.choice([math.nan, math.inf, -math.inf])
                if dtype in NO_INF:
                    value = math.nan
                t[rng.randrange(n)] = complex(0.0, value) if dtype.is_complex else value
            parts[str(i)] = t
        truth = sorted(f"m.{k}" for k, t in parts.items() if not finite(t))
        torch.save({"m": parts, "steps": torch.arange(4), "epoch": 6}, path)
        found = scan(path)
        assert found.tensors == len(FLOATS) and found.epoch == 7
        assert found.bad_count == len(truth)
        assert sorted(found.bad) == truth[: ckptscan.MAX_NAMES]


def test_largest_finite_values_and_subnormals_are_finite(tmp_path: Path) -> None:
    parts = {
        str(dt): torch.tensor(
            [torch.finfo(dt).max, -torch.finfo(dt).max, torch.finfo(dt).tiny / 2], dtype=dt
        )
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    }
    assert all(finite(t) for t in parts.values())
    torch.save(parts, tmp_path / "edge.pt")
    assert scan(tmp_path / "edge.pt").bad_count == 0


def test_shared_storage_parameters_and_pickled_modules(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = math.inf
    base = torch.zeros(10)
    # A whole module (not weights_only-safe: the scan runs none of it), a view sharing the
    # storage of another tensor, and a bare Parameter.
    torch.save(
        {"ema": model, "a": base, "view": base[2:5], "p": torch.nn.Parameter(torch.ones(2))},
        tmp_path / "m.pt",
    )
    found = scan(tmp_path / "m.pt")
    assert found.bad == ("ema",) or found.bad_count == 1, found
    assert found.tensors >= 4


def hostile_zip(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", "little")
    return path


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch PWNED",))


def test_a_pickle_that_names_os_system_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = hostile_zip(tmp_path / "evil.pt", pickle.dumps({"x": _Boom(), "epoch": 1}))
    found = scan(path)
    assert found.tensors == 0 and found.epoch == 2
    assert not (tmp_path / "PWNED").exists()


def test_big_endian_archives_read_their_own_byte_order(tmp_path: Path) -> None:
    torch.save({"w": torch.tensor([1.0, math.nan, 2.0])}, tmp_path / "le.pt")
    src = zipfile.ZipFile(tmp_path / "le.pt")
    with zipfile.ZipFile(tmp_path / "be.pt", "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
            out.writestr(info.filename, data)
    assert scan(tmp_path / "le.pt").bad_count == 1
    assert scan(tmp_path / "be.pt").bad_count == 1
    # The same bytes read as little-endian would miss it: the order is what decides.
    raw = zipfile.ZipFile(tmp_path / "be.pt").read("le/data/0")
    assert not nonfinite_in(raw, ckptscan.FLOATING["float32"])


def test_what_it_cannot_read_is_an_error_never_finite(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(8)}, tmp_path / "ok.pt")
    whole = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "torn.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ScanError):
        scan(tmp_path / "torn.pt")
    # A storage member missing, a member that is not whole elements.
    src = zipfile.ZipFile(tmp_path / "ok.pt")
    for name, change in (("gone.pt", "drop"), ("odd.pt", "cut")):
        with zipfile.ZipFile(tmp_path / name, "w") as out:
            for info in src.infolist():
                data = src.read(info)
                if "/data/" in info.filename:
                    if change == "drop":
                        continue
                    data = data[:-1]
                out.writestr(info.filename, data)
        with pytest.raises(ScanError):
            scan(tmp_path / name)
    # A floating type it does not know: a float8 tensor (UntypedStorage + _rebuild_tensor_v3)
    # whose dtype's name is changed in the pickle to one no torch has.
    torch.save({"w": torch.zeros(4, dtype=torch.float8_e5m2)}, tmp_path / "f8.pt")
    src = zipfile.ZipFile(tmp_path / "f8.pt")
    with zipfile.ZipFile(tmp_path / "unknown.pt", "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"float8_e5m2" in data
                data = data.replace(b"float8_e5m2", b"float4_e9m9")  # same length
            out.writestr(info.filename, data)
    with pytest.raises(ScanError, match="dtype float4_e9m9"):
        scan(tmp_path / "unknown.pt")


def test_a_cancelled_scan_stops_at_its_next_chunk(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(ckptscan.CHUNK)}, tmp_path / "big.pt")  # 4 chunks
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        scan(tmp_path / "big.pt", cancel=cancel)
