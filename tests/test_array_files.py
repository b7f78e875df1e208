"""Array files (training/values.py): safetensors written here read by the safetensors library and
the other way round, 0-d arrays, alignment, memory maps, npz beside it, a Trainer's state."""

from __future__ import annotations

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from onnx_autodiff.demo import classifier_model
from onnx_autodiff.training import Trainer, TrainingArtifacts, TrainingError, generate_artifacts
from onnx_autodiff.training.values import (
    arrays_writer,
    load_arrays,
    safetensors_metadata,
    safetensors_writer,
)
from onnx_autodiff.files import json_text, write_atomically


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "__step__": np.array(7, np.int64),  # a 0-d array, as in every state dict
        "flag": np.array([True, False, True]),
        "half": rng.standard_normal(5).astype(np.float16),
        "W": rng.standard_normal((3, 4)).astype(np.float32),
        "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,  # not C-contiguous
        "big_endian": np.arange(6, dtype=">f8"),
        "empty": np.zeros((0, 4), np.float32),
        "large": rng.standard_normal(1 << 15).astype(np.float32),  # 128 KiB: memory-mapped when read
    }


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        # safetensors is little-endian; npz keeps the byte order
        assert got[name].shape == array.shape and got[name].dtype.newbyteorder("<") == array.dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_written_safetensors_read_by_the_library(tmp_path):
    path = tmp_path / "a.safetensors"
    write_atomically(path, arrays_writer(path, arrays()))
    assert_same(load_file(path), arrays())
    assert_same(load_arrays(path), arrays())


def test_library_safetensors_read_here_large_arrays_mapped(tmp_path):
    path = tmp_path / "b.safetensors"
    save_file({k: np.require(v, v.dtype.newbyteorder("<"), "C") for k, v in arrays().items()}, path,
              metadata={"note": "from the library"})
    loaded = load_arrays(path)
    assert_same(loaded, arrays())
    assert isinstance(loaded["large"], np.memmap) and not isinstance(loaded["W"], np.memmap)
    assert safetensors_metadata(path) == {"note": "from the library"}


def test_tensors_are_aligned_and_metadata_kept(tmp_path):
    path = tmp_path / "c.safetensors"
    write_atomically(path, safetensors_writer(arrays(), {"run": "{}"}))
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    assert size % 8 == 0
    header = json.loads(data[8:8 + size])
    assert header.pop("__metadata__") == {"run": "{}"} == safetensors_metadata(path)
    for name, entry in header.items():
        assert (8 + size + entry["data_offsets"][0]) % arrays()[name].dtype.itemsize == 0, name
    assert header["__step__"]["shape"] == []


def test_bfloat16_round_trip(tmp_path):
    path = tmp_path / "bf.safetensors"
    values = {"w": np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16)}
    write_atomically(path, safetensors_writer(values))
    assert_same(load_arrays(path), values)


def test_format_by_extension_when_written_by_content_when_read(tmp_path):
    for name in ("state.npz", "state", "state.safetensors"):
        write_atomically(tmp_path / name, arrays_writer(tmp_path / name, arrays()))
        assert_same(load_arrays(tmp_path / name), arrays())
    assert (tmp_path / "state").read_bytes()[:2] == b"PK"  # npz unless the name says .safetensors
    write_atomically(tmp_path / "named", safetensors_writer(arrays()))
    assert_same(load_arrays(tmp_path / "named"), arrays())


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="'s'.*safetensors cannot hold"):
        safetensors_writer({"s": np.array(["text"])})
    with pytest.raises(ValueError, match="reserved"):
        safetensors_writer({"__metadata__": np.zeros(1)})
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="neither an npz nor a safetensors"):
        load_arrays(tmp_path / "x.safetensors")
    good = tmp_path / "good.safetensors"
    write_atomically(good, safetensors_writer(arrays()))
    (tmp_path / "cut.safetensors").write_bytes(good.read_bytes()[:-4])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_arrays(tmp_path / "cut.safetensors")


def zipfile_npz(arrays: dict) -> bytes:
    """The npz that zipfile writes of ``arrays`` as npz_writer describes it (small members with
    writestr, the others opened with force_zip64), the bytes npz_writer must write."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            if array.nbytes >= 1 << 16 or array.dtype.hasobject:
                with archive.open(member, "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, array)
            else:
                out = io.BytesIO()
                np.lib.format.write_array(out, array)
                archive.writestr(member, out.getvalue())
    return buffer.getvalue()


def test_npz_written_as_zipfile_writes_it(tmp_path):
    values = {**arrays(), "naïve": np.arange(3.0), "objects": np.array([{"a": 1}, None], dtype=object),
              **{f"p{i}": np.full((2, 2), i, np.float32) for i in range(5)}}
    path = tmp_path / "a.npz"
    write_atomically(path, arrays_writer(path, values))
    assert path.read_bytes() == zipfile_npz(values)


def test_npz_of_more_members_than_a_zip_counts(tmp_path):
    values = {f"s{i}": np.array(i, np.int32) for i in range(1 << 16)}  # zip64's end records
    path = tmp_path / "many.npz"
    write_atomically(path, arrays_writer(path, values))
    assert path.read_bytes() == zipfile_npz(values)


def test_trainer_state_round_trip(tmp_path):
    artifacts = generate_artifacts(classifier_model(loss=False), loss="cross_entropy")
    trainer = Trainer(artifacts)
    rng = np.random.default_rng(1)
    for _ in range(3):
        trainer.step({"X": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 4, 8)})
    path = tmp_path / "checkpoint.safetensors"
    trainer.save_checkpoint(path)
    assert load_file(str(path))["__step__"] == 3  # a safetensors file, as the name says
    fresh = Trainer(artifacts)
    fresh.load_checkpoint(path)
    assert fresh.step_count == 3
    assert_same(fresh.state_dict(), trainer.state_dict())


@pytest.mark.parametrize("checkpoint_format", ["npz", "safetensors"])
def test_artifacts_saved_with_either_checkpoint_format(tmp_path, checkpoint_format):
    artifacts = generate_artifacts(classifier_model(loss=False), loss="cross_entropy")
    artifacts.save(tmp_path, checkpoint_format="safetensors" if checkpoint_format == "npz" else "npz")
    written = artifacts.save(tmp_path, checkpoint_format=checkpoint_format)  # over the other: one checkpoint left
    assert sorted(p.name for p in tmp_path.glob("checkpoint.*")) == [f"checkpoint.{checkpoint_format}"]
    assert written["checkpoint"] == str(tmp_path / f"checkpoint.{checkpoint_format}")
    loaded = TrainingArtifacts.load(tmp_path)
    assert_same(loaded.checkpoint, artifacts.checkpoint)
    with pytest.raises(TrainingError, match="checkpoint_format must be one of npz, safetensors"):
        artifacts.save(tmp_path, checkpoint_format="pt")


def test_artifacts_json_reads_back_with_a_line_per_key_two_levels_deep(tmp_path):
    artifacts = generate_artifacts(classifier_model(loss=False), loss="cross_entropy")
    artifacts.save(tmp_path)
    text = (tmp_path / "artifacts.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(artifacts.layout))
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    assert [re.match(r' "(\w+)": ', line)[1] for line in lines if line.startswith(' "')] == sorted(artifacts.layout)
    assert any(line.startswith('  "carry": [[') for line in lines)  # a second level's value on its line


def test_json_text_writes_what_json_reads():
    document = {"b": [1, 2.5, [3, None]], "a": {"x": {"deep": [1, {"q": "two\nlines"}]}, "y": []}, "c": {}}
    text = json_text(document)
    assert json.loads(text) == document
    assert text == '{\n "a": {\n  "x": {"deep": [1, {"q": "two\\nlines"}]},\n  "y": []\n },\n "b": [1, 2.5, [3, null]],\n "c": {}\n}'
