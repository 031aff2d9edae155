/*
 * kvoffload.transfer._rows: scattered row copies between two CPU buffers.
 *
 * kvoffload.transfer.host_copy's "bytes" strategy copies row src_rows[i] of
 * one flat byte buffer to row dst_rows[i] of another. In Python that is one
 * memoryview slice assignment per run of rows consecutive on both sides,
 * about 0.1 us of interpreter overhead each, which at 16 KiB rows is a third
 * of the time the bytes take (docs/transfer.md). Here the same loop is one
 * call: every index is checked first (an out-of-range one raises IndexError
 * and nothing is copied), then the runs are found and copied, with the GIL
 * released for copies of RELEASE_GIL_BYTES or more (taking it back can wait
 * on another thread, which a copy of a few microseconds should not). host_copy falls back to its Python loop when this module was not
 * built (setup.py marks it optional); tests/transfer/test_host_copy.py runs
 * both on the same plans.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RELEASE_GIL_BYTES ((Py_ssize_t)1 << 20)

/* An index buffer: contiguous signed 64-bit integers (numpy's int64). */
static int
get_index(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN))
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a contiguous buffer of int64 (format 'q' or 'l'), got "
                     "format '%s' with items of %zd bytes",
                     name, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The first index of `rows` (n of them) outside [0, limit), or -1. */
static Py_ssize_t
first_out_of_range(const int64_t *rows, Py_ssize_t n, int64_t limit)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= limit)
            return i;
    }
    return -1;
}

PyDoc_STRVAR(copy_rows_doc,
"copy_rows(src, dst, src_rows, dst_rows, row_bytes, /) -> int\n"
"--\n"
"\n"
"Copy row src_rows[i] of src to row dst_rows[i] of dst, for every i.\n"
"\n"
"src and dst are contiguous byte buffers (dst writable), read as rows of\n"
"row_bytes; src_rows and dst_rows are equally long contiguous int64\n"
"buffers. Every index is checked before anything is copied (IndexError\n"
"names the first one out of range). Rows consecutive on both sides are\n"
"copied as one run; returns the number of runs. Overlapping buffers are\n"
"copied run by run in order, each run as memmove would.");

static PyObject *
copy_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "copy_rows() takes 5 positional arguments (src, dst, src_rows, dst_rows, "
                     "row_bytes), got %zd",
                     nargs);
        return NULL;
    }
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[4]);
    if (row_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (row_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes must be positive, got %zd", row_bytes);
        return NULL;
    }
    Py_buffer src, dst, si, di;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (get_index(args[2], &si, "src_rows") < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (get_index(args[3], &di, "dst_rows") < 0) {
        PyBuffer_Release(&si);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = si.len / 8;
    const int64_t *s = (const int64_t *)si.buf, *d = (const int64_t *)di.buf;
    if (di.len / 8 != n) {
        PyErr_Format(PyExc_ValueError,
                     "src_rows and dst_rows must be equally long, got %zd and %zd", n,
                     di.len / 8);
        goto done;
    }
    int64_t src_rows = (int64_t)(src.len / row_bytes), dst_rows = (int64_t)(dst.len / row_bytes);
    Py_ssize_t bad = first_out_of_range(s, n, src_rows);
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError,
                     "src_rows[%zd] = %lld is out of range for a source of %lld rows of %zd "
                     "bytes",
                     bad, (long long)s[bad], (long long)src_rows, row_bytes);
        goto done;
    }
    bad = first_out_of_range(d, n, dst_rows);
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError,
                     "dst_rows[%zd] = %lld is out of range for a destination of %lld rows of "
                     "%zd bytes",
                     bad, (long long)d[bad], (long long)dst_rows, row_bytes);
        goto done;
    }
    const char *from = (const char *)src.buf;
    char *to = (char *)dst.buf;
    int overlap = from < to + dst.len && to < from + src.len;
    Py_ssize_t runs = 0;
    PyThreadState *released = NULL;
    if (n > 0 && n >= RELEASE_GIL_BYTES / row_bytes) /* n * row_bytes, without overflow */
        released = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n;) {
        int64_t s0 = s[i], d0 = d[i];
        Py_ssize_t k = 1;
        while (i + k < n && s[i + k] == s0 + k && d[i + k] == d0 + k)
            k++;
        size_t len = (size_t)k * (size_t)row_bytes;
        const char *a = from + s0 * row_bytes;
        char *b = to + d0 * row_bytes;
        if (overlap)
            memmove(b, a, len);
        else
            memcpy(b, a, len);
        runs++;
        i += k;
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    result = PyLong_FromSsize_t(runs);
done:
    PyBuffer_Release(&di);
    PyBuffer_Release(&si);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef rows_methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL, copy_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT,
    "kvoffload.transfer._rows",
    "Scattered row copies between two CPU buffers (see kvoffload.transfer.host_copy).",
    0,
    rows_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__rows(void)
{
    return PyModule_Create(&rows_module);
}
