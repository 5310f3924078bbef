"""Writes the .npy fixtures of tests/npy_test.cc with numpy (run from this folder with Debian's /usr/bin/python3).

Every valid fixture holds element i (C order) = i * 0.5 - 1, so the test can check values without numpy.
"""

import numpy as np
import numpy.lib.format as fmt


def counting(shape, dtype):
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64) * 0.5 - 1).astype(dtype).reshape(shape)


def save(name, array, version=None):
    with open(name, "wb") as f:
        fmt.write_array(f, array, version=version, allow_pickle=False)


# Accepted: float32 and float16, 0-d to 5-d, an empty dim, format versions 1.0 (numpy's default), 2.0 and 3.0.
save("f4_0d.npy", counting((), "<f4"))
save("f4_1d.npy", counting((5,), "<f4"))
save("f4_2d.npy", counting((2, 3), "<f4"))
save("f4_3d.npy", counting((2, 3, 4), "<f4"))
save("f4_4d.npy", counting((2, 1, 3, 2), "<f4"))
save("f4_5d.npy", counting((1, 2, 1, 2, 2), "<f4"))
save("f4_empty.npy", counting((0, 3), "<f4"))
save("f2_0d.npy", counting((), "<f2"))
save("f2_1d.npy", counting((7,), "<f2"))
save("f2_3d.npy", counting((2, 3, 4), "<f2"))
save("f2_4d.npy", counting((1, 2, 2, 3), "<f2"))
save("f4_2d_v2.npy", counting((2, 3), "<f4"), version=(2, 0))
save("f4_2d_v3.npy", counting((2, 3), "<f4"), version=(3, 0))

# Rejected: other dtypes, big-endian, Fortran order, a structured dtype.
save("f8_2d.npy", counting((2, 3), "<f8"))
save("i4_1d.npy", np.arange(4, dtype="<i4"))
save("f4_be_1d.npy", counting((3,), ">f4"))
save("f4_fortran_2d.npy", np.asfortranarray(counting((2, 3), "<f4")))
save("structured.npy", np.zeros(2, dtype=[("a", "<f4"), ("b", "<f4")]))
