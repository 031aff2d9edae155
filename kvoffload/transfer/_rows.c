/*
 * kvoffload.transfer._rows: scattered row copies between two CPU buffers,
 * and the row plan of a transfer job.
 *
 * kvoffload.transfer.host_copy's "bytes" strategy copies row src_rows[i] of
 * one flat byte buffer to row dst_rows[i] of another. In Python that is one
 * memoryview slice assignment per run of rows consecutive on both sides,
 * about 0.1 us of interpreter overhead each, which at 16 KiB rows is a third
 * of the time the bytes take (docs/transfer.md). Here the same loop is one
 * call: every index is checked first (an out-of-range one raises IndexError
 * and nothing is copied), then the runs are found and copied, with the GIL
 * released for copies of RELEASE_GIL_BYTES or more (taking it back can wait
 * on another thread, which a copy of a few microseconds should not).
 *
 * plan_rows is kvoffload.transfer.block_map.plan_copy's fast path: it checks
 * a job's ids and expands them into rows in one call where numpy takes a
 * dozen, each slow right after a copy has flushed the caches (docs/transfer.md).
 * It only says yes or no; every refusal is worded by the numpy path.
 *
 * Without this module (setup.py marks it optional) host_copy falls back to
 * its Python loop and plan_copy to numpy; tests/transfer/test_host_copy.py
 * and test_block_map.py run both and compare them.
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
    if ((uintptr_t)view->buf % _Alignof(int64_t) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be 8-byte aligned", name);
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
"copied run by run in order, each run as memmove would. An index that\n"
"changes during the copy (its buffer shares memory with dst, or another\n"
"thread writes it) stops it with RuntimeError, the rows before it copied.");

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
    int changed = 0;
    for (Py_ssize_t i = 0; i < n;) {
        /* Checked again as they are read: the indices may share memory with
         * dst, or another thread may write them while the GIL is released. */
        int64_t s0 = s[i], d0 = d[i];
        if (s0 < 0 || s0 >= src_rows || d0 < 0 || d0 >= dst_rows) {
            changed = 1;
            break;
        }
        Py_ssize_t k = 1;
        while (i + k < n && s0 + k < src_rows && d0 + k < dst_rows && s[i + k] == s0 + k &&
               d[i + k] == d0 + k)
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
    if (changed)
        PyErr_SetString(PyExc_RuntimeError,
                        "src_rows or dst_rows changed during the copy (an index buffer shared "
                        "with dst, or written by another thread); rows were copied up to the "
                        "first changed index");
    else
        result = PyLong_FromSsize_t(runs);
done:
    PyBuffer_Release(&di);
    PyBuffer_Release(&si);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* One side of a plan: ids (n of them) in [0, limit) (limit < 0: no bound),
 * and never one whose last row would pass INT64_MAX, expanded to rows
 * id*factor .. id*factor + factor - 1, the first `first` and last `last`
 * rows dropped, into out (exactly n*factor - first - last of them: checked
 * by the caller). 0 when an id is out of range. */
static int
expand_side(const int64_t *ids, Py_ssize_t n, int64_t factor, int64_t first, int64_t limit,
            int64_t *out, Py_ssize_t n_out)
{
    /* the last row of an id below `fits` still fits in int64 (as in
     * block_map._check_ids) */
    int64_t fits = factor == 1 ? INT64_MAX : (INT64_MAX - (factor - 1)) / factor + 1;
    if (limit < 0 || limit > fits)
        limit = fits;
    if (first_out_of_range(ids, n, limit) >= 0)
        return 0;
    if (factor == 1) {
        memcpy(out, ids + first, (size_t)n_out * sizeof(int64_t));
        return 1;
    }
    for (Py_ssize_t j = 0; j < n_out; j++) {
        int64_t row = j + first;
        out[j] = ids[row / factor] * factor + row % factor;
    }
    return 1;
}

static int
compare_int64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* 1 if ids (n of them) repeat one, 0 if not, -1 (MemoryError) on failure. */
static int
has_repeats(const int64_t *ids, Py_ssize_t n)
{
    Py_ssize_t i = 1;
    while (i < n && ids[i - 1] < ids[i])
        i++;
    if (i >= n) /* strictly increasing: the common case of consecutive ids */
        return 0;
    int64_t *sorted = PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(sorted, ids, (size_t)n * sizeof(int64_t));
    qsort(sorted, (size_t)n, sizeof(int64_t), compare_int64);
    int found = 0;
    for (i = 1; i < n && !found; i++)
        found = sorted[i - 1] == sorted[i];
    PyMem_Free(sorted);
    return found;
}

PyDoc_STRVAR(plan_rows_doc,
"plan_rows(src_ids, src_factor, src_first, src_last, src_limit,\n"
"          dst_ids, dst_factor, dst_first, dst_last, dst_limit, src_out, dst_out, /) -> bool\n"
"--\n"
"\n"
"Expand both sides of a copy plan into their rows, if the ids allow it.\n"
"\n"
"Each side's ids (a contiguous int64 buffer) expand block b to rows\n"
"b*factor .. b*factor+factor-1, less the first `first` and last `last` rows\n"
"of the side, into its out buffer (writable int64, exactly that long).\n"
"Returns False, with the outs undefined, when an id lies outside\n"
"[0, limit) (limit < 0: no bound), its last row would pass INT64_MAX, or a\n"
"destination id repeats; the caller\n"
"then says which (kvoffload.transfer.block_map.plan_copy). Raises ValueError\n"
"for a factor < 1, skips outside [0, factor) or outs of the wrong length.");

static PyObject *
plan_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "plan_rows() takes 12 positional arguments, got %zd",
                     nargs);
        return NULL;
    }
    long long num[2][4]; /* per side: factor, first, last, limit */
    for (int side = 0; side < 2; side++) {
        for (int k = 0; k < 4; k++) {
            num[side][k] = PyLong_AsLongLong(args[side * 5 + 1 + k]);
            if (num[side][k] == -1 && PyErr_Occurred())
                return NULL;
        }
        long long factor = num[side][0], first = num[side][1], last = num[side][2];
        if (factor < 1 || first < 0 || first >= factor || last < 0 || last >= factor) {
            PyErr_Format(PyExc_ValueError,
                         "%s factor %lld must be >= 1 and its skips (%lld, %lld) in [0, factor)",
                         side ? "dst" : "src", factor, first, last);
            return NULL;
        }
    }
    Py_buffer view[4] = {{0}};
    static const char *names[4] = {"src_ids", "dst_ids", "src_out", "dst_out"};
    PyObject *objs[4] = {args[0], args[5], args[10], args[11]};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++) {
        if (get_index(objs[got], &view[got], names[got]) < 0)
            goto done;
        if (got >= 2 && view[got].readonly) {
            PyErr_Format(PyExc_ValueError, "%s must be writable", names[got]);
            got++;
            goto done;
        }
    }
    int ok = 1;
    for (int side = 0; side < 2 && ok; side++) {
        Py_ssize_t n = view[side].len / 8;
        long long factor = num[side][0], first = num[side][1], last = num[side][2];
        Py_ssize_t n_out = view[side + 2].len / 8;
        if (n > PY_SSIZE_T_MAX / 8 / factor || (n ? n * factor - first - last : 0) != n_out ||
            (n == 1 && first + last >= factor) || (n == 0 && first + last)) {
            PyErr_Format(PyExc_ValueError,
                         "%s has %zd ids x%lld skipping %lld+%lld rows: %zd outs do not fit",
                         names[side], n, factor, first, last, n_out);
            goto done;
        }
        ok = expand_side((const int64_t *)view[side].buf, n, factor, first, num[side][3],
                         (int64_t *)view[side + 2].buf, n_out);
    }
    if (ok) {
        int repeats = has_repeats((const int64_t *)view[1].buf, view[1].len / 8);
        if (repeats < 0)
            goto done;
        ok = !repeats;
    }
    result = PyBool_FromLong(ok);
done:
    while (got-- > 0)
        PyBuffer_Release(&view[got]);
    return result;
}

static PyMethodDef rows_methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL, copy_rows_doc},
    {"plan_rows", (PyCFunction)(void (*)(void))plan_rows, METH_FASTCALL, plan_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rows_module = {
    PyModuleDef_HEAD_INIT,
    "kvoffload.transfer._rows",
    "Row copies between CPU buffers and transfer row plans (see kvoffload.transfer).",
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
