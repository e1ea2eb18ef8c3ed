"""Small real data sets for scripts/train_data_parallel.py and scripts/train_torch.py:
scikit-learn's bundled digits, MNIST IDX files; and what the two training scripts share
(their common arguments, the batch split, the accuracy report).

Neither data set needs the network: the digits ship inside scikit-learn (``pip install
'.[examples]'`` in the source tree), and MNIST is read from IDX files already on disk.
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys

import numpy as np

try:
    import mpicomm
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mpicomm
from mpicomm.errors import InvalidArgumentError, invalid  # noqa: E402

# IDX type codes -> big-endian numpy dtypes
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx(path):
    """Read one IDX file (optionally gzip-compressed) into a native-endian ndarray.

    Raises InvalidArgumentError naming the file for a bad magic number, an unknown type
    code, or a size that does not match the header.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise invalid("path", str(path), "an IDX file (magic bytes 0x00 0x00 <type> <ndim>)")
    code, ndim = data[2], data[3]
    if code not in _IDX_TYPES:
        raise invalid("path", str(path), "an IDX file with type code one of "
                      + ", ".join(f"0x{c:02X}" for c in _IDX_TYPES) + f" (got 0x{code:02X})")
    hdr = 4 + 4 * ndim
    if len(data) < hdr:
        raise invalid("path", str(path), f"an IDX file with {ndim} dimension sizes after the magic")
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, 4))
    dt = np.dtype(_IDX_TYPES[code])
    want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(data) - hdr != want:
        raise invalid("path", str(path), f"{want} bytes of data after the header for shape {shape} "
                      f"(got {len(data) - hdr})")
    return np.frombuffer(data, dt, offset=hdr).reshape(shape).astype(dt.newbyteorder("="))


def write_idx(path, array):
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in .gz)."""
    a = np.asarray(array)
    codes = {np.dtype(v).newbyteorder("=").str: k for k, v in _IDX_TYPES.items()}
    code = codes.get(a.dtype.newbyteorder("=").str)
    if code is None:
        raise invalid("array.dtype", str(a.dtype), "uint8, int8, int16, int32, float32 or float64")
    body = bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, ">u4").tobytes() \
        + a.astype(a.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(body)


def _find(data_path, stem):
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        p = os.path.join(data_path, name)
        if os.path.exists(p):
            return p
    raise InvalidArgumentError(f"invalid DATA_PATH={data_path!r}: expected a directory holding {stem} "
                               "(or .gz), as distributed by the MNIST site")


def load_mnist(data_path):
    """MNIST from IDX files in ``data_path``: ((x_train, y_train), (x_test, y_test)).

    Images are flattened to float64 in [0, 1]; labels are int64.
    """
    if not os.path.isdir(data_path):
        raise invalid("DATA_PATH", data_path, "a directory holding the four MNIST IDX files")
    arrs = {k: read_idx(_find(data_path, v)) for k, v in MNIST_FILES.items()}

    def xs(a):
        return a.reshape(a.shape[0], -1).astype(np.float64) / 255.0

    return ((xs(arrs["train_images"]), arrs["train_labels"].astype(np.int64)),
            (xs(arrs["test_images"]), arrs["test_labels"].astype(np.int64)))


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's bundled 8x8 digits (1797 images): ((x_train, y_train), (x_test, y_test)).

    Pixels scaled to [0, 1] (float64), labels int64; a fixed split drawn from ``seed``.
    """
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:
        raise ImportError("the digits data set needs scikit-learn: pip install '.[examples]' in mpicomm's source tree "
                          "(or pip install scikit-learn), or set DATA_PATH to a directory of MNIST "
                          "IDX files") from None
    d = _load()
    x = d.data.astype(np.float64) / 16.0
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    te, tr = order[:n_test], order[n_test:]
    return (x[tr], y[tr]), (x[te], y[te])


# ---------------------------------------------------------------- what the training scripts share

def training_parser(description):
    """An argument parser with the options both training scripts take; each adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (split over the ranks)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit with status 1 if the held-out accuracy ends below this")
    return p


def local_batch_size(batch_size, n):
    """This rank's share of the global batch (exits where there are more ranks than samples)."""
    if batch_size < n:
        raise SystemExit(f"--batch-size {batch_size} must be at least the number of ranks ({n})")
    return batch_size // n


def finish(correct, total, elapsed, rank, min_accuracy):
    """Print the held-out accuracy of all ranks' counts (rank 0), finalize; the exit status."""
    acc = correct / total
    if rank == 0:
        print(f"held-out accuracy: {acc:.4f} ({correct}/{total}), training time {elapsed:.2f} s", flush=True)
    mpicomm.finalize()
    if min_accuracy is not None and acc < min_accuracy:
        return 1
    return 0


__all__ = ["read_idx", "write_idx", "load_mnist", "load_digits", "training_parser", "local_batch_size", "finish"]
