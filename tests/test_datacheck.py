"""The data YAML check of every job (agent/data/datacheck.py, issue 8): a staged YAML may not point
outside the staged folder, and ``libreyolo doctor`` runs for staged and local datasets alike.

Staged cases go through the real download (fake Hub on 127.0.0.1) and the real unpacker; the
doctor cases run the real ``libreyolo doctor`` (a few seconds each, marked ``training``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from agent.config.model import DatasetSection
from agent.data import datacheck
from agent.data.datacheck import (
    DataCheck,
    DoctorError,
    StagingError,
    check_data_yaml,
    run_doctor,
)
from agent.data.dataset import stage_dataset
from agent.demo import make_dataset
from tests.fakes.hub import FakeHub
from tests.test_archive import reg, special, tar_bytes, write
from tests.test_dataset import env_for
from tests.test_dataset import hub as hub  # the fixture, used by name

requires_libreyolo = pytest.mark.skipif(
    shutil.which("libreyolo", path=str(Path(sys.executable).parent)) is None
    and shutil.which("libreyolo") is None,
    reason="the training stack (libreyolo) is not installed: run ./install.sh",
)


@pytest.fixture(autouse=True)
def no_libreyolo_datasets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LibreYOLO looks in ~/datasets first: point it at a folder of the test's own (absent)."""
    where = tmp_path / "libreyolo-datasets"
    monkeypatch.setenv("LIBREYOLO_DATASETS_DIR", str(where))
    return where


def staged_archive(yaml_text: str, *extra: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """A tiny dataset folder ``ds`` with images/train, images/val and the given data.yaml."""
    return tar_bytes(
        special("ds", tarfile.DIRTYPE),
        reg("ds/images/train/a.png", b"png"),
        reg("ds/images/val/b.png", b"png"),
        reg("ds/data.yaml", yaml_text.encode()),
        *extra,
    )


def stage(hub: FakeHub, tmp_path: Path, archive: bytes, **kw: bool) -> object:
    hub.add_file("dataset", "org/ds", "ds.tar", archive)
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "data")
    return stage_dataset(ds, env_for(hub.url, tmp_path), data_yaml="ds/data.yaml", **kw)


def outside_folder(tmp_path: Path) -> Path:
    """A real dataset-looking folder next to the staged one."""
    write(tmp_path / "elsewhere" / "images" / "x.png", b"png")
    return tmp_path / "elsewhere"


# Each: (data.yaml text, the start of what the error says about it, extra archive members).
# {out} is a folder outside the staged dataset; dest is tmp_path/data, the YAML in data/ds.
# (A long value is cut short in the message; where it resolves to is shown in full.)
ESCAPES = {
    "path_absolute": ("path: {out}\ntrain: images\nval: images\n", "path '/", ()),
    "path_relative": ("path: ../../elsewhere\ntrain: images\nval: images\n", "path '../..", ()),
    "train_absolute": ("train: {out}/images\nval: images/val\n", "train '/", ()),
    "val_relative": ("train: images/train\nval: ../../elsewhere/images\n", "val '../../", ()),
    "test_in_a_list": (
        "train: images/train\nval: images/val\ntest: [images/val, {out}/images]\n",
        "test[1] '/",
        (),
    ),
    "image_list_line": (
        "train: train.txt\nval: images/val\n",
        "train list train.txt line 2 '../../elsewhere/images/x.png'",
        (reg("ds/train.txt", b"images/train/a.png\n../../elsewhere/images/x.png\n"),),
    ),
    "annotations": (
        "train: images/train\nval: images/val\nannotations:\n  val: {out}/val.json\n",
        "annotations.val '/",
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_staged_yaml_pointing_outside_the_dataset_is_refused(
    hub: FakeHub, tmp_path: Path, case: str
) -> None:
    text, key, extra = ESCAPES[case]
    out = outside_folder(tmp_path)
    archive = staged_archive(text.format(out=out), *extra)

    with pytest.raises(StagingError) as info:
        stage(hub, tmp_path, archive)  # doctor off: nothing else would have noticed

    msg = str(info.value)
    yaml_path = tmp_path / "data" / "ds" / "data.yaml"
    assert msg.startswith(
        f"the data YAML {yaml_path} points outside the staged dataset {tmp_path / 'data'}: "
    )
    assert f": {key}" in msg
    assert f"resolves to {out}" in msg
    assert msg.endswith("or set dataset.allow_outside_paths = true to allow it")
    assert "\n" not in msg and not info.value.retryable


def test_relative_path_found_in_libreyolos_datasets_dir_is_outside(
    hub: FakeHub, tmp_path: Path, no_libreyolo_datasets_dir: Path
) -> None:
    # LibreYOLO 1.6.0 takes `path: .` from LIBREYOLO_DATASETS_DIR (~/datasets) when that exists:
    # training would read every dataset on the box, not the staged one.
    no_libreyolo_datasets_dir.mkdir()
    with pytest.raises(StagingError) as info:
        stage(hub, tmp_path, staged_archive("path: .\ntrain: images/train\nval: images/val\n"))
    msg = str(info.value)
    assert (
        f"path '.' resolves to {no_libreyolo_datasets_dir} (LibreYOLO takes a relative path "
        f"from LIBREYOLO_DATASETS_DIR ({no_libreyolo_datasets_dir}) first); fix the YAML" in msg
    )


def test_staged_yaml_inside_the_dataset_is_accepted(hub: FakeHub, tmp_path: Path) -> None:
    # dest is reached through a symlinked parent; `path:` spells the real location: inside.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    text = (
        f"path: {tmp_path / 'real' / 'data' / 'ds'}\ntrain: images/train\n"
        "val: [images/val, ./images/../images/val]\ntest: list.txt\n"
    )
    archive = staged_archive(
        text,
        special("ds/images/all", tarfile.SYMTYPE, "train"),
        reg("ds/list.txt", b"# images\nimages/all/a.png\n\n"),
    )
    hub.add_file("dataset", "org/ds", "ds.tar", archive)
    ds = DatasetSection(repo="org/ds", file="ds.tar", dest=tmp_path / "link" / "data")
    result = stage_dataset(ds, env_for(hub.url, tmp_path), data_yaml="ds/data.yaml")
    assert result.data_yaml == tmp_path / "link" / "data" / "ds" / "data.yaml"
    assert result.warnings == []


def test_allow_outside_paths_lets_a_staged_yaml_point_outside(hub: FakeHub, tmp_path: Path) -> None:
    out = outside_folder(tmp_path)
    result = stage(
        hub,
        tmp_path,
        staged_archive(f"path: {out}\ntrain: images\nval: images\n"),
        allow_outside_paths=True,
    )
    assert getattr(result, "data_yaml", None) == tmp_path / "data" / "ds" / "data.yaml"


def test_a_local_yaml_may_point_anywhere(tmp_path: Path) -> None:
    out = outside_folder(tmp_path)
    yaml_path = write(tmp_path / "mine" / "data.yaml", f"path: {out}\ntrain: images\n".encode())
    check = check_data_yaml(yaml_path, doctor=False, allow_outside_paths=False, staged_root=None)
    assert check == DataCheck(data_yaml=yaml_path, root=out, doctor_status="off")
    # A user's own YAML next to a staged dataset is not the archive's: not checked either.
    check = check_data_yaml(
        yaml_path, doctor=False, allow_outside_paths=False, staged_root=tmp_path / "data"
    )
    assert check.doctor_status == "off" and check.warnings == []


def test_local_yaml_taken_from_libreyolos_datasets_dir_is_a_warning(
    tmp_path: Path, no_libreyolo_datasets_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (no_libreyolo_datasets_dir / "ds").mkdir(parents=True)
    yaml_path = write(tmp_path / "ds" / "data.yaml", b"path: ds\ntrain: images\nval: images\n")
    (tmp_path / "ds" / "ds").mkdir()  # the folder the user meant
    caplog.set_level(logging.WARNING, logger="agent.data.dataset")
    check = check_data_yaml(yaml_path, doctor=False, allow_outside_paths=False, staged_root=None)
    assert check.root == no_libreyolo_datasets_dir / "ds"
    assert check.warnings == [
        f"path 'ds' in {yaml_path} resolves to {no_libreyolo_datasets_dir / 'ds'}, not to "
        f"{tmp_path / 'ds' / 'ds'}: LibreYOLO takes a relative path from LIBREYOLO_DATASETS_DIR "
        f"({no_libreyolo_datasets_dir}) first; make path absolute, or remove it to use the "
        "YAML's folder"
    ]
    assert f"dataset: {check.warnings[0]}" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "the data YAML {p} does not exist; check train.data"),
        (b"train: [images\nval: x\n", "the data YAML {p} is not valid YAML ("),
        (b"- train\n- val\n", "the data YAML {p} holds a list, not keys like path, train, val"),
        (b"path: [a, b]\ntrain: x\n", "path in the data YAML {p} is \"['a', 'b']\", not a folder"),
    ],
    ids=["missing", "invalid", "not_a_mapping", "path_not_a_string"],
)
def test_unusable_yaml_is_a_clear_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    p = tmp_path / "data.yaml"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(StagingError) as info:
        check_data_yaml(p, doctor=True, allow_outside_paths=False, staged_root=None)
    assert str(info.value).startswith(message.format(p=p)), str(info.value)
    assert "\n" not in str(info.value)


def test_doctor_is_skipped_with_a_warning_without_libreyolo(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    yaml_path = make_dataset(tmp_path / "ds", train=1, val=1)
    caplog.set_level(logging.WARNING, logger="agent.data.dataset")
    check = check_data_yaml(
        yaml_path,
        doctor=True,
        allow_outside_paths=False,
        staged_root=None,
        find_libreyolo=lambda: None,
    )
    assert check.doctor_status == "skipped" and check.doctor is None
    assert check.warnings == [
        f"libreyolo doctor skipped, {yaml_path} was not checked: the libreyolo command was not "
        f"found next to {sys.executable} or on PATH; install the training stack (pip install "
        "libreyolo==1.6.0)"
    ]
    assert "dataset: libreyolo doctor skipped" in caplog.text


# --------------------------------------------------------------------------------------------
# The real doctor on local datasets


@requires_libreyolo
def test_doctor_passes_a_healthy_local_dataset(tmp_path: Path) -> None:
    yaml_path = make_dataset(tmp_path / "ds")
    check = check_data_yaml(
        yaml_path, doctor=True, allow_outside_paths=False, staged_root=None, timeout_s=120
    )
    assert check.doctor_status == "passed"
    assert check.doctor is not None and check.doctor["exit_code"] == 0
    assert check.doctor["summary"]["errors"] == 0
    assert check.root == tmp_path / "ds"
    assert any(w.startswith("balance.class_few_instances: ") for w in check.warnings)


def _class_out_of_range(root: Path) -> None:
    (root / "labels" / "train" / "000.txt").write_text("3 0.5 0.5 0.2 0.2\n")


def _no_val_images(root: Path) -> None:
    shutil.rmtree(root / "images" / "val")


@requires_libreyolo
@pytest.mark.parametrize(
    ("breakage", "check_id"),
    [(_class_out_of_range, "labels.class_out_of_range"), (_no_val_images, "config.path_not_found")],
    ids=["class_out_of_range", "no_val_images"],
)
def test_doctor_stops_a_broken_local_dataset(
    tmp_path: Path, breakage: object, check_id: str
) -> None:
    yaml_path = make_dataset(tmp_path / "ds")
    assert callable(breakage)
    breakage(tmp_path / "ds")
    with pytest.raises(DoctorError) as info:
        check_data_yaml(
            yaml_path, doctor=True, allow_outside_paths=False, staged_root=None, timeout_s=120
        )
    msg = str(info.value)
    assert msg.startswith(f"libreyolo doctor found 1 error(s) in {yaml_path}: {check_id}: ")
    assert msg.endswith("; fix the dataset, or set dataset.doctor = false to train anyway")
    assert [f["check_id"] for f in info.value.findings if f["severity"] == "error"] == [check_id]
    assert not os.path.exists(tmp_path / "ds" / ".libreyolo-agent-staged.json")


# --------------------------------------------------------------------------------------------
# run_doctor and its report


@requires_libreyolo
def test_run_doctor_on_a_missing_yaml(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match=r"libreyolo doctor could not check .* \(exit 3\)"):
        run_doctor(tmp_path / "nope.yaml", timeout_s=120)


def test_doctor_json_report_parsing() -> None:
    text = 'log line\n{"summary": {"errors": 0}, "findings": []}\n'
    assert datacheck._parse_json_object(text) == {"summary": {"errors": 0}, "findings": []}
    assert datacheck._parse_json_object("no json here") is None
    many = {"findings": [{"check_id": "x", "paths": [str(i) for i in range(100)]}]}
    trimmed = datacheck._trim_findings(many)
    assert len(trimmed[0]["paths"]) == 20 and trimmed[0]["paths_truncated"] == 80
    assert json.dumps(trimmed)  # JSON-ready for the report
