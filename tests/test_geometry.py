"""Input geometries (issue 21): --resize caffe is OpenCV's cv2.resize, --resize torchvision is torchvision's
Resize(256) + CenterCrop(224) (rendered here with PIL only), the default geometry is unchanged, and
evaluation says in one line when the data's geometry is not the one the weights expect."""
from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import train
from alexnet.checkpoint import load
from alexnet.evaluation import prepare, read_names
from alexnet.models import build_model
from data.decode import RESIZE_MODES
from data.geometry import opencv_linear, window_offset
from data.preprocess import Options, preprocess
from data.reader import SplitData
from tests.caffe_nets import small_blobs, write_model
from tests.conftest import REPO, load_script
from tests.test_caffe import continue_overrides
from tests.test_theano_weights import CLASSES, write_folder

SAMPLE = REPO.parent / "shared" / "imagenet_sample"
# Real images: long side after Resize(256) 256 + 85, 1, 7 (odd: CenterCrop's rounding matters), 114
# (grayscale), 115 (portrait, 1124 x 1632), 620 (411 x 120), 100 (135 x 97: enlarged)
NAMES = ("n01440764_tench", "n01667778_terrapin", "n02110627_affenpinscher", "n02815834_beaker",
         "n03617480_kimono", "n04238763_slide_rule", "n04254120_soap_dispenser")
# sha256 of (name, image) pairs, sorted by name, written by the code before the new modes existed
BEFORE = {"short": "4c7a4acfa4b371c8f7b7a24c0c7669ec", "warp": "8a1e3169c9be295b4851d651df80c069"}
NOTICE = "expects --resize"


# -- the pixels, on real ImageNet images ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """mode -> {name: the stored 256 x 256 image} of NAMES preprocessed in that mode (computed once each)."""
    if not SAMPLE.is_dir():
        pytest.skip(f"{SAMPLE} (real ImageNet images, see its README) is absent")
    tree = tmp_path_factory.mktemp("sample") / "train"
    for name in NAMES:
        (tree / name.split("_")[0]).mkdir(parents=True)
        shutil.copy(SAMPLE / f"{name}.JPEG", tree / name.split("_")[0])
    cache = {}

    def images(mode: str) -> dict[str, np.ndarray]:
        if mode not in cache:
            out = tmp_path_factory.mktemp(mode)
            summary = preprocess(tree, out, opts=Options(per_file=4, resize=mode), workers=1, quiet=True)
            assert summary["meta"]["resize"] == mode
            data = SplitData(out, "train")
            index = np.arange(len(data))
            names = [n.split("/")[1][:-len(".JPEG")] for n in read_names(data, index)]
            cache[mode] = dict(zip(names, data.read(index)[0]))
        return cache[mode]

    return images


def torchvision_reference(path) -> np.ndarray:
    """torchvision's Resize(256) + CenterCrop(224) on a PIL image, as its transforms compute them."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    size = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
    im = im.resize(size, Image.Resampling.BILINEAR)
    top, left = int(round((size[1] - 224) / 2.0)), int(round((size[0] - 224) / 2.0))
    return np.asarray(im.crop((left, top, left + 224, top + 224)))


@pytest.mark.processes
def test_torchvision_geometry_center_crop_is_torchvisions(stored):
    images = stored("torchvision")
    for name in NAMES:
        ours = images[name][16:240, 16:240].astype(int)  # data.augment's center crop: (256 - 224) // 2
        assert np.abs(ours - torchvision_reference(SAMPLE / f"{name}.JPEG")).max() <= 1, name


@pytest.mark.processes
def test_caffe_geometry_is_opencvs_resize(stored):
    cv2 = pytest.importorskip("cv2")
    images = stored("caffe")
    for name in NAMES:
        decoded = np.asarray(Image.open(SAMPLE / f"{name}.JPEG").convert("RGB"))
        np.testing.assert_array_equal(images[name], cv2.resize(decoded, (256, 256)), err_msg=name)


def test_opencv_linear_equals_cv2_resize_on_sample_images():
    """Bit-equal, as DESIGN.md states: every 10th sample image (50, every size and aspect among them), at
    256 (preprocessing's side) and 227 (a size that divides no side)."""
    cv2 = pytest.importorskip("cv2")
    if not SAMPLE.is_dir():
        pytest.skip(f"{SAMPLE} (real ImageNet images, see its README) is absent")
    for path in sorted(SAMPLE.glob("*.JPEG"))[::10]:
        decoded = np.asarray(Image.open(path).convert("RGB"))
        for size in (256, 227):
            np.testing.assert_array_equal(opencv_linear(decoded, size), cv2.resize(decoded, (size, size)),
                                          err_msg=f"{path.name} at {size}")


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(BEFORE))
def test_default_and_warp_geometries_are_unchanged(stored, mode):
    digest = hashlib.sha256()
    for name, image in sorted(stored(mode).items()):
        digest.update(f"{name.split('_')[0]}/{name}.JPEG".encode())  # the stored name
        digest.update(image.tobytes())
    assert digest.hexdigest()[:32] == BEFORE[mode]


def test_opencv_linear_on_any_size():
    """Shrinking, enlarging, exactly by 2 (OpenCV's area path), 1-pixel sides."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(0)
    shapes = [(1, 1), (1, 5), (7, 1), (2, 3), (512, 512), (768, 768), (255, 257), (513, 511), (1000, 7),
              *(tuple(rng.integers(1, 700, 2)) for _ in range(12))]
    for h, w in shapes:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for size in (256, 227, 31):
            np.testing.assert_array_equal(opencv_linear(image, size), cv2.resize(image, (size, size)),
                                          err_msg=f"{h} x {w} to {size}")


def test_the_torchvision_window_always_fits_at_256():
    """CenterCrop(224)'s offset minus 16 lies inside every resized side (no image where it is impossible)."""
    for length in range(256, 4000):
        offset = window_offset(length, 256)
        assert 0 <= offset <= length - 256 and offset + 16 == int(round((length - 224) / 2.0)), length


# -- what evaluation says --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def geometries(tmp_path_factory) -> dict:
    """mode -> the same synthetic images preprocessed at 256 in that mode (CLASSES classes)."""
    from data.synthetic import generate
    src = tmp_path_factory.mktemp("synth_geometry")
    generate(src, num_classes=CLASSES, train_per_class=2, val_per_class=1, seed=4, quirks=False,
             min_side=64, max_side=200)
    out = {}
    for mode in RESIZE_MODES:
        out[mode] = tmp_path_factory.mktemp(f"data_{mode}")
        preprocess(src / "train", out[mode], src / "val", src / "val.txt", Options(size=256, per_file=8, resize=mode),
                   workers=1, quiet=True)
    return out


def notices(weights, root, capsys) -> list[str]:
    capsys.readouterr()
    prepare(weights, root)
    return [line for line in capsys.readouterr().err.splitlines() if NOTICE in line]


def public_weights(fmt: str, tmp_path):
    if fmt == "torchvision":
        path = tmp_path / "tv.pt"
        torch.save(build_model("owt", CLASSES, 0.125, crop=224, init="torch").state_dict(), path)
        return path
    if fmt == "caffe":
        return write_model(tmp_path, "alexnet", "V2", small_blobs(crop=67, classes=CLASSES))
    write_folder(tmp_path / "theano", 1, seed=0)
    return tmp_path / "theano"


@pytest.mark.parametrize("fmt, expected", [("torchvision", "torchvision"), ("caffe", "caffe"), ("theano", "warp")])
def test_public_weights_name_their_geometry(geometries, tmp_path, capsys, fmt, expected):
    weights = public_weights(fmt, tmp_path)
    for mode, root in geometries.items():
        lines = notices(weights, root, capsys)
        if mode == expected:
            assert lines == [], mode
        else:
            assert len(lines) == 1 and f"holds --resize {mode} --size 256" in lines[0], (mode, lines)
            assert f"preprocess with scripts/preprocess.py --resize {expected} --size 256" in lines[0]


def test_evaluate_prints_the_notice_once(geometries, tmp_path, capsys):
    weights = public_weights("caffe", tmp_path)
    args = ["--weights", str(weights), "--device", "cpu", "--no-progress"]
    assert load_script("evaluate").main(["--data", str(geometries["short"]), *args]) == 0
    assert [line.startswith("evaluate.py: note: ") for line in capsys.readouterr().err.splitlines()
            if NOTICE in line] == [True]
    assert load_script("evaluate").main(["--data", str(geometries["caffe"]), *args]) == 0
    assert NOTICE not in capsys.readouterr().err


def test_checkpoints_expect_their_own_datas_geometry(geometries, tmp_path, capsys):
    """A converted Caffe checkpoint expects Caffe's; fine-tuned on short data, short (stored by the trainer;
    for a checkpoint without it, its config's data.root meta.json; none readable: no notice)."""
    converted = tmp_path / "bvlc.pt"
    assert load_script("convert_weights").main([str(write_model(tmp_path, "caffenet", "V1", small_blobs(
        crop=67, classes=CLASSES))), str(converted)]) == 0
    assert notices(converted, geometries["caffe"], capsys) == []
    assert "--resize caffe --size 256" in notices(converted, geometries["short"], capsys)[0]

    run_dir = tmp_path / "run"
    extra = {"model.lrn": "caffe", "model.arch": "caffenet", "train.batch_size": 4}
    overrides = continue_overrides(geometries["short"], run_dir, converted, **extra)
    assert train.main([str(REPO / "configs" / "caffenet.yaml"), *overrides]) == 0
    tuned = run_dir / "checkpoints" / "last.pt"
    state = load(tuned)
    assert (state["resize"], state["image_size"]) == ("short", 256)
    assert notices(tuned, geometries["short"], capsys) == []
    assert "--resize short --size 256" in notices(tuned, geometries["torchvision"], capsys)[0]

    del state["resize"]
    torch.save(state, tmp_path / "older.pt")
    assert notices(tmp_path / "older.pt", geometries["short"], capsys) == []
    assert len(notices(tmp_path / "older.pt", geometries["warp"], capsys)) == 1
    state["config"]["data"]["root"] = str(tmp_path / "moved")
    torch.save(state, tmp_path / "moved.pt")
    assert notices(tmp_path / "moved.pt", geometries["warp"], capsys) == []
