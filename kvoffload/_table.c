/*
 * kvoffload._table: the block table in C.
 *
 * docs/block-table.md is the specification; kvoffload.table.PyBlockTable is
 * the pure-Python reference this file is tested against
 * (tests/core/test_table.py runs both on the same random programs).
 *
 * Layout
 * ------
 * Every entry (a resident block or a ghost) is one slot of a growable array
 * of `Entry`. Free slots are chained through `next`; slots at and above
 * `top` have never been used. An entry is either *in line* on the
 * intrusive doubly-linked list of its tag (8 lists, oldest at the head,
 * most recent at the tail) or, for a resident tag, *set aside*: an eviction
 * walked past it (busy or protected) or `move` put it at the oldest end.
 * Entries set aside are older than every entry in line of their tag (an
 * eviction takes in-line entries from the oldest end, so every entry it
 * passes is older than the ones left), and ordered among themselves by a
 * stamp given when they were set aside (later stamps for evictions,
 * earlier ones for `move`). Each resident tag keeps them in an `Aside`
 * array of (stamp, entry) records: its first `ready` records are a binary
 * min-heap by stamp of the ones that are ready (evictable), the rest the
 * busy ones in no order; an entry set aside holds its record's position in
 * `prev`. So an eviction takes the ready entries set aside in order in
 * O(log n) each and never looks at a busy one, and a busy entry that
 * becomes ready again is back in its place in vLLM's order in O(log n).
 *
 * The hint window. A use (a hash of a hinted request) is a `Node` of a
 * growable pool: on its ticket's chain (`tnext`, in position order; the
 * ticket, in a ring indexed by its number, knows its first use and count)
 * and on the circular doubly-linked queue of its entry's uses, ascending by
 * key, whose first node is `qhead[entry]` (a parallel array, allocated
 * while the window holds a use). So `unhint` finds every use through its
 * ticket without hashing, and removes each in O(1) in any order. A hinted
 * hash without another entry has a *hint-only* entry (tag HINT_ONLY), which
 * no other method sees, on no list: the window reaches it through its uses
 * (most of a request hinted far ahead is such entries, made by one hint
 * and filed by one store, so keeping them on a list cost two moves each),
 * and tbl_compact and _check find them in the entry array. When its last
 * use leaves, the entry joins list STALE, as invisible and no longer
 * hinted, and is freed at the next `unhint` (or when the window empties):
 * the request that just left is usually served next, and its store makes
 * the entry resident instead of freeing it and making a new one. With hint order on, hinted resident entries
 * are *held*: records of the table's `held` array, kept like the entries
 * set aside (ready ones in a heap, busy ones after it) with minus the key
 * of their next use as stamp, so the farthest next use comes first; an
 * entry's place (in line, set aside, held) is `Entry.place`. Held entries
 * come and go with every hint and unhint (each new one the farthest, the
 * heap's new top), and are read in order only by a spill or `farthest`:
 * so their heap is made only when it is read, and kept for as many sifts
 * as it has records (which pays for making it), then let go again.
 *
 * The index is an open-addressing hash table of int32 entry numbers (-1:
 * empty), a power of two in size, linear probing from a Fibonacci hash of
 * the key's Python hash, load factor at most 0.5, deletion by backward
 * shift (no tombstones). Removing an entry finds its slot by entry number,
 * so it never calls back into Python.
 *
 * Calls into Python and atomicity
 * -------------------------------
 * Looking a key up may run Python code (a key's __hash__ and __eq__, a
 * `protected` container's __contains__). Every method therefore works in
 * two phases: phase 1 hashes each key once, looks every key up and checks
 * everything (this is where exceptions come from; nothing has changed yet),
 * allocating whatever phase 2 needs (result lists, room for new entries);
 * phase 2 changes the table without calling Python code, so it cannot fail.
 * While a method runs, `in_call` is set and any method called re-entrantly
 * (from that Python code) raises RuntimeError, so the table cannot change
 * under phase 1. The keys a method is given are copied (with new
 * references) out of the caller's list before any Python code runs, so a
 * key's __eq__ mutating that list cannot free them under us.
 *
 * References the table drops (keys of removed entries) are not released
 * in phase 2: they are kept in `trash` (room reserved in phase 1) and
 * released when the method is done, with `in_call` cleared, so a key's
 * __del__ sees a consistent table and may even use it.
 *
 * The table holds strong references to its keys and handles. It does not
 * take part in cyclic garbage collection: keys are block hashes (bytes)
 * and handles block ids (ints), neither of which can refer back to it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define N_RESIDENT 4
#define N_TAGS 8
/* the list of hint-only entries: hinted hashes with no other entry */
#define HINT_ONLY N_TAGS /* on no list (its List stays empty) */
/* entries that were hint-only until the last unhint (freed at the next) */
#define STALE (N_TAGS + 1)
#define N_LISTS (N_TAGS + 2)
/* the key of a hinted use: ticket * USE_STRIDE + min(position, USE_STRIDE - 1) */
#define USE_STRIDE (INT64_C(1) << 24)
#define MAX_TICKET (INT64_C(1) << 39)
#define MIN_CAP 8
#define MIN_BITS 4
#define MAX_ENTRIES (INT32_MAX - 1)
/* keys a call snapshots on the stack before it needs the heap */
#define SMALL_ITEMS 32
#define SMALL_WALK 64
#define SMALL_FRONT 32
#define MIN_ASIDE 16

typedef struct {
    PyObject *key;    /* strong; NULL in a free slot */
    Py_hash_t hash;   /* hash(key), computed once when the entry was made */
    PyObject *handle; /* strong; NULL for a ghost (and a free slot) */
    int32_t prev;     /* list neighbours, -1 at the ends (set aside: its */
    int32_t next;     /* record's position); a free slot: the next free slot */
    int32_t ref;      /* -1 in flight, 0 ready, > 0 pinned (-2: marked within one call) */
    uint8_t tag;      /* 0..3 resident, 4..7 ghost, HINT_ONLY, STALE */
    uint8_t place;    /* IN_LINE, SET_ASIDE or HELD (resident only) */
} Entry;

/* where a resident entry is: on its tag's list, or a record of its tag's
   `Aside` (set aside) or of the table's `held` (held for a hinted use) */
enum { IN_LINE, SET_ASIDE, HELD };

_Static_assert(sizeof(Entry) <= 40, "an Entry must stay within 40 bytes");

typedef struct {
    int32_t head; /* oldest */
    int32_t tail; /* most recent */
    Py_ssize_t size;
} List;

typedef struct {
    int64_t stamp;
    int32_t ix;
} Rec;

/* the entries set aside in one resident tag, or the held entries of the
   table (their stamp: minus the key of their next use, so farthest first) */
typedef struct {
    Rec *v;        /* [0, ready): a min-heap by stamp; [ready, n): busy */
    int32_t n;
    int32_t ready;
    int32_t cap;
    int32_t keep;  /* sifts left in heap order: -1 always (set aside); held: */
                   /* 0 while [0, ready) is in no order (held_order makes it) */
} Aside;

/* one use of a hash by a hinted request: on the circular, doubly linked
   queue of its entry's uses (ascending keys; the entry's `qhead` is the
   first) and on its ticket's chain (in position order) */
typedef struct {
    int64_t key;
    int32_t ix;    /* the entry */
    int32_t next;  /* queue neighbours; a free node: the next free node */
    int32_t prev;
    int32_t tnext; /* the ticket's next use, -1 at its end */
} Node;

/* a ticket in the window: its first use and how many it has (-1: gone) */
typedef struct {
    int32_t first;
    int32_t n;
} Ticket;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    int32_t cap;       /* slots allocated */
    int32_t top;       /* slots [0, top) have been handed out */
    int32_t used;      /* entries alive: resident + ghosts */
    int32_t free_head; /* chain of free slots below top */
    int32_t *index;
    int bits;          /* the index has 1 << bits slots */
    size_t mask;
    Py_ssize_t resident;
    Py_ssize_t pinned;
    Py_ssize_t in_flight;
    Py_ssize_t walked; /* entries evictions walked past (a statistic) */
    /* victims evictions took, by tag: [0] from its order, [1] held (statistics) */
    Py_ssize_t evicted[N_RESIDENT][2];
    List lists[N_LISTS];
    Aside aside[N_RESIDENT];
    /* the hint window (docs/block-table.md); all NULL / 0 while empty */
    int32_t *qhead;    /* per entry slot: its first use, -1: none */
    Node *nodes;
    int32_t ncap, ntop, nfree;
    Ticket *ring;      /* tickets [tbase, tnext), at ticket & (rcap - 1) */
    int64_t rcap, tbase, tnext;
    Py_ssize_t window_requests, window_uses, window_keys, window_resident, holds, window_found;
    Aside held;
    Py_ssize_t held_n[N_RESIDENT], held_ready[N_RESIDENT];
    char hold;         /* hint order: hinted resident entries are held */
    int64_t late;      /* the next stamp of an eviction (counts up) */
    int64_t early;     /* the next stamp of a move to the oldest end (down) */
    int8_t ready_to[N_RESIDENT];
    int8_t in_flight_to[N_RESIDENT];
    char touch_ghosts;
    char in_call;
    PyObject **trash; /* references to drop once the current call is done */
    Py_ssize_t ntrash;
    Py_ssize_t trash_cap;
} BlockTable;

/* ------------------------------------------------------------------------ */
/* errors                                                                   */

static PyObject *
reentered(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "BlockTable used re-entrantly: a key's __eq__/__hash__ or a "
                    "protected container called back into the table during "
                    "another call on it");
    return NULL;
}

#define ENTER(t)                         \
    do {                                 \
        if ((t)->in_call)                \
            return reentered();          \
        (t)->in_call = 1;                \
    } while (0)

/* KeyError(key) / ValueError(key) with the key as the only argument (a
   tuple key stays one argument) */
static void
raise_key(PyObject *type, PyObject *key)
{
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(type, args);
        Py_DECREF(args);
    }
}

/* ------------------------------------------------------------------------ */
/* tags and integers (messages as kvoffload.table's)                        */

/* an int in [lo, hi) (an IntEnum member too, not a bool): 0 with *out set,
   1 if it is not one, -1 with an exception */
static int
int_in(PyObject *o, long lo, long hi, long *out)
{
    if (PyLong_Check(o) && !PyBool_Check(o)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(o, &overflow);
        if (!overflow && v >= lo && v < hi) {
            *out = v;
            return 0;
        }
        if (v == -1 && PyErr_Occurred())
            return -1;
    }
    return 1;
}

static int
resident_tag(PyObject *o, int *out)
{
    long v;
    int r = int_in(o, 0, N_RESIDENT, &v);
    if (r == 0) {
        *out = (int)v;
        return 0;
    }
    if (r > 0)
        PyErr_Format(PyExc_ValueError, "resident tag must be 0..3, got %R", o);
    return -1;
}

static int
ghost_tag(PyObject *o, int *out)
{
    long v;
    int r = int_in(o, N_RESIDENT, N_TAGS, &v);
    if (r == 0) {
        *out = (int)v;
        return 0;
    }
    if (r > 0)
        PyErr_Format(PyExc_ValueError, "ghost tag must be 4..7, got %R", o);
    return -1;
}

static int
any_tag(PyObject *o, int *out)
{
    long v;
    int r = int_in(o, 0, N_TAGS, &v);
    if (r == 0) {
        *out = (int)v;
        return 0;
    }
    if (r > 0)
        PyErr_Format(PyExc_ValueError, "tag must be 0..7, got %R", o);
    return -1;
}

/* `list(obj)`, except that an exact list or tuple is used as it is */
static PyObject *
as_seq(PyObject *obj)
{
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj))
        return Py_NewRef(obj);
    return PySequence_List(obj);
}

/* ------------------------------------------------------------------------ */
/* argument parsing for METH_FASTCALL | METH_KEYWORDS                       */

#define MAX_ARGS 10

/* a method's arguments: the first `nreq` required, at most `npos`
   positional, the rest keyword-only */
typedef struct {
    const char *fname;
    const char *names[MAX_ARGS];
    int nreq, npos, nmax;
    PyObject *interned[MAX_ARGS]; /* the names, interned on first use */
} Sig;

/* the argument of keyword `name`, or -1 (an exception set if one occurred) */
static int
keyword_index(Sig *sig, PyObject *name)
{
    for (int j = 0; j < sig->nmax; j++) {
        if (sig->interned[j] == name) /* the usual case: both interned */
            return j;
    }
    for (int j = 0; j < sig->nmax; j++) {
        if (PyUnicode_Compare(name, sig->interned[j]) == 0)
            return j;
    }
    if (PyErr_Occurred())
        return -1;
    PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", sig->fname,
                 name);
    return -1;
}

static int
parse_args(Sig *sig, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
    for (int i = 0; i < sig->nmax; i++)
        out[i] = NULL;
    if (nargs > sig->npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     sig->fname, sig->npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    if (kwnames != NULL) {
        if (sig->interned[0] == NULL) {
            for (int j = 0; j < sig->nmax; j++) {
                sig->interned[j] = PyUnicode_InternFromString(sig->names[j]);
                if (sig->interned[j] == NULL)
                    return -1;
            }
        }
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nkw; k++) {
            int j = keyword_index(sig, PyTuple_GET_ITEM(kwnames, k));
            if (j < 0)
                return -1;
            if (out[j] != NULL) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'",
                             sig->fname, sig->names[j]);
                return -1;
            }
            out[j] = args[nargs + k];
        }
    }
    for (int j = 0; j < sig->nreq; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)",
                         sig->fname, sig->names[j], j + 1);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* the index                                                                */

static inline size_t
home(Py_hash_t hash, int bits)
{
    return (size_t)(((uint64_t)hash * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits));
}

static int
bits_for(Py_ssize_t count)
{
    int bits = MIN_BITS;
    while ((size_t)count * 2 > ((size_t)1 << bits) * 1)
        bits++;
    return bits;
}

/* 1 equal, 0 not, -1 error; the caller has checked that the hashes match */
static inline int
keys_equal(PyObject *stored, PyObject *key)
{
    if (stored == key)
        return 1;
    if (PyBytes_CheckExact(stored) && PyBytes_CheckExact(key)) {
        Py_ssize_t n = PyBytes_GET_SIZE(stored);
        return n == PyBytes_GET_SIZE(key) &&
               memcmp(PyBytes_AS_STRING(stored), PyBytes_AS_STRING(key), (size_t)n) == 0;
    }
    return PyObject_RichCompareBool(stored, key, Py_EQ);
}

/* the entry of `key`, -1 if none, -2 with an exception set */
static int32_t
tbl_find(BlockTable *t, PyObject *key, Py_hash_t hash)
{
    size_t i = home(hash, t->bits);
    for (;;) {
        int32_t ix = t->index[i];
        if (ix < 0)
            return -1;
        Entry *e = &t->entries[ix];
        if (e->key == key)
            return ix;
        if (e->hash == hash) {
            /* may run Python code: in_call keeps the table as it is */
            int r = keys_equal(e->key, key);
            if (r > 0)
                return ix;
            if (r < 0)
                return -2;
        }
        i = (i + 1) & t->mask;
    }
}

/* index entry `ix`, whose key is known to be absent; there is room */
static inline void
index_put(BlockTable *t, int32_t ix)
{
    size_t i = home(t->entries[ix].hash, t->bits);
    while (t->index[i] >= 0)
        i = (i + 1) & t->mask;
    t->index[i] = ix;
}

/* take entry `ix` out of the index (backward-shift deletion) */
static void
index_del(BlockTable *t, int32_t ix)
{
    int32_t *index = t->index;
    size_t mask = t->mask;
    int bits = t->bits;
    size_t i = home(t->entries[ix].hash, bits);
    while (index[i] != ix)
        i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int32_t jx = index[j];
        if (jx < 0)
            break;
        size_t k = home(t->entries[jx].hash, bits);
        /* jx may fill the hole at i when i lies on its probe path [k, j) */
        int movable = (j > i) ? (k <= i || k > j) : (k <= i && k > j);
        if (movable) {
            index[i] = jx;
            i = j;
        }
    }
    index[i] = -1;
}

/* a new index of 1 << bits slots holding every live entry; -1 (no
   exception set) when out of memory, the old index kept */
static int
index_rebuild(BlockTable *t, int bits)
{
    size_t size = (size_t)1 << bits;
    int32_t *ni = PyMem_Malloc(size * sizeof(int32_t));
    if (ni == NULL)
        return -1;
    memset(ni, 0xff, size * sizeof(int32_t));
    PyMem_Free(t->index);
    t->index = ni;
    t->bits = bits;
    t->mask = size - 1;
    for (int32_t i = 0; i < t->top; i++) {
        if (t->entries[i].key != NULL)
            index_put(t, i);
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* entries and lists                                                        */

/* room for `k` more entries (slots and index) without reallocating */
static int
tbl_reserve(BlockTable *t, Py_ssize_t k)
{
    if (k > (Py_ssize_t)MAX_ENTRIES - t->used) {
        PyErr_SetString(PyExc_OverflowError, "a BlockTable holds at most 2**31 - 2 entries");
        return -1;
    }
    Py_ssize_t need = t->used + k;
    if (need > t->cap) {
        Py_ssize_t nc = (Py_ssize_t)t->cap + t->cap / 2;
        if (nc < need)
            nc = need;
        if (nc > MAX_ENTRIES)
            nc = MAX_ENTRIES;
        Entry *ne = PyMem_Realloc(t->entries, (size_t)nc * sizeof(Entry));
        if (ne == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->entries = ne; /* larger than cap says until the queue heads grow too */
        if (t->qhead != NULL) {
            int32_t *nq = PyMem_Realloc(t->qhead, (size_t)nc * sizeof(int32_t));
            if (nq == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->qhead = nq;
        }
        t->cap = (int32_t)nc;
    }
    if ((size_t)need * 2 > ((size_t)1 << t->bits) * 1) {
        if (index_rebuild(t, bits_for(need)) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static inline int32_t
entry_alloc(BlockTable *t)
{
    int32_t ix;
    if (t->free_head >= 0) {
        ix = t->free_head;
        t->free_head = t->entries[ix].next;
    }
    else {
        ix = t->top++;
    }
    t->used++;
    if (t->qhead != NULL)
        t->qhead[ix] = -1;
    return ix;
}

/* the first use of entry ix in the window, -1 if it has none (not hinted) */
static inline int32_t
qhead_of(BlockTable *t, int32_t ix)
{
    return t->qhead != NULL ? t->qhead[ix] : -1;
}

/* the slot only: the caller has unlinked it, taken it out of the index and
   taken over its references */
static inline void
entry_free(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    e->key = NULL;
    e->handle = NULL;
    e->prev = -1;
    e->next = t->free_head;
    t->free_head = ix;
    t->used--;
}

static inline void
list_unlink(BlockTable *t, int32_t ix)
{
    Entry *E = t->entries;
    Entry *e = &E[ix];
    List *l = &t->lists[e->tag];
    if (e->prev >= 0)
        E[e->prev].next = e->next;
    else
        l->head = e->next;
    if (e->next >= 0)
        E[e->next].prev = e->prev;
    else
        l->tail = e->prev;
    l->size--;
}

/* in line at the most recent end of list L (which sets the entry's tag) */
static inline void
list_append(BlockTable *t, int32_t ix, int L)
{
    Entry *E = t->entries;
    Entry *e = &E[ix];
    List *l = &t->lists[L];
    e->tag = (uint8_t)L;
    e->place = IN_LINE;
    e->next = -1;
    e->prev = l->tail;
    if (l->tail >= 0)
        E[l->tail].next = ix;
    else
        l->head = ix;
    l->tail = ix;
    l->size++;
}

/* entry ix (unlinked, or new) becomes hint-only: on no list */
static inline void
hint_only(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    e->tag = HINT_ONLY;
    e->place = IN_LINE;
    e->prev = e->next = -1;
}

/* ------------------------------------------------------------------------ */
/* entries set aside                                                        */

static inline void
rec_put(BlockTable *t, Aside *A, int32_t pos, Rec r)
{
    A->v[pos] = r;
    t->entries[r.ix].prev = pos;
}

/* whether A's ready records are kept in heap order (one sift more) */
static inline int
heap_kept(Aside *A)
{
    if (A->keep == 0)
        return 0;
    if (A->keep > 0)
        A->keep--;
    return 1;
}

static void
heap_up(BlockTable *t, Aside *A, int32_t pos)
{
    if (!heap_kept(A))
        return; /* the record stays where it was put */
    Rec r = A->v[pos];
    while (pos > 0) {
        int32_t parent = (pos - 1) / 2;
        if (A->v[parent].stamp < r.stamp)
            break;
        rec_put(t, A, pos, A->v[parent]);
        pos = parent;
    }
    rec_put(t, A, pos, r);
}

static void
heap_down(BlockTable *t, Aside *A, int32_t pos)
{
    if (!heap_kept(A))
        return;
    Rec r = A->v[pos];
    for (;;) {
        int32_t c = 2 * pos + 1;
        if (c >= A->ready)
            break;
        if (c + 1 < A->ready && A->v[c + 1].stamp < A->v[c].stamp)
            c++;
        if (r.stamp < A->v[c].stamp)
            break;
        rec_put(t, A, pos, A->v[c]);
        pos = c;
    }
    rec_put(t, A, pos, r);
}

/* room for k more records in A; -1 with MemoryError */
static int
recs_reserve(Aside *A, Py_ssize_t k)
{
    if (k <= (Py_ssize_t)A->cap - A->n)
        return 0;
    Py_ssize_t nc = (Py_ssize_t)A->cap * 2;
    if (nc < A->n + k)
        nc = A->n + k;
    if (nc < MIN_ASIDE)
        nc = MIN_ASIDE;
    Rec *nv = nc <= MAX_ENTRIES ? PyMem_Realloc(A->v, (size_t)nc * sizeof(Rec)) : NULL;
    if (nv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    A->v = nv;
    A->cap = (int32_t)nc;
    return 0;
}

/* room for k more records of tag `tag`; -1 with MemoryError */
static int
aside_reserve(BlockTable *t, int tag, Py_ssize_t k)
{
    return recs_reserve(&t->aside[tag], k);
}

/* the records entry e (set aside or held) is in */
static inline Aside *
recs_of(BlockTable *t, Entry *e)
{
    return e->place == HELD ? &t->held : &t->aside[e->tag];
}

/* the unlinked resident entry ix joins records A as `place` (room reserved) */
static void
recs_add(BlockTable *t, Aside *A, int32_t ix, int64_t stamp, int place)
{
    Entry *e = &t->entries[ix];
    Rec r = {stamp, ix};
    e->place = (uint8_t)place;
    e->next = -1;
    if (place == HELD) {
        t->held_n[e->tag]++;
        t->held_ready[e->tag] += e->ref == 0;
    }
    if (e->ref != 0) {
        rec_put(t, A, A->n++, r);
        return;
    }
    if (A->ready < A->n) /* the first busy record makes room at the end */
        rec_put(t, A, A->n, A->v[A->ready]);
    A->n++;
    rec_put(t, A, A->ready++, r);
    heap_up(t, A, A->ready - 1);
}

/* set the unlinked resident entry ix aside in tag `tag` (room reserved) */
static inline void
aside_add(BlockTable *t, int32_t ix, int tag, int64_t stamp)
{
    t->entries[ix].tag = (uint8_t)tag;
    recs_add(t, &t->aside[tag], ix, stamp, SET_ASIDE);
}

/* an entry set aside or held became busy (was ready): out of the heap */
static void
aside_busy(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    Aside *A = recs_of(t, e);
    int32_t pos = e->prev, last = --A->ready;
    Rec r = A->v[pos];
    if (e->place == HELD)
        t->held_ready[e->tag]--;
    if (pos != last) {
        rec_put(t, A, pos, A->v[last]);
        if (pos > 0 && A->v[(pos - 1) / 2].stamp > A->v[pos].stamp)
            heap_up(t, A, pos);
        else
            heap_down(t, A, pos);
    }
    rec_put(t, A, last, r); /* the first busy slot */
}

/* an entry set aside or held became ready (was busy): into the heap */
static void
aside_ready(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    Aside *A = recs_of(t, e);
    int32_t pos = e->prev;
    Rec r = A->v[pos];
    if (e->place == HELD)
        t->held_ready[e->tag]++;
    if (pos != A->ready)
        rec_put(t, A, pos, A->v[A->ready]);
    rec_put(t, A, A->ready++, r);
    heap_up(t, A, A->ready - 1);
}

/* take an entry set aside or held out of its records */
static void
aside_remove(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    Aside *A = recs_of(t, e);
    if (e->prev < A->ready)
        aside_busy(t, ix);
    int32_t pos = e->prev, last = --A->n;
    if (pos != last)
        rec_put(t, A, pos, A->v[last]);
    if (e->place == HELD)
        t->held_n[e->tag]--;
    e->place = IN_LINE;
    e->prev = -1;
}

/* out of its tag's order, wherever it is in it */
static inline void
entry_detach(BlockTable *t, int32_t ix)
{
    if (t->entries[ix].place != IN_LINE)
        aside_remove(t, ix);
    else
        list_unlink(t, ix);
}

/* ------------------------------------------------------------------------ */
/* held entries                                                             */

/* room for k more held records */
static int
held_reserve(BlockTable *t, Py_ssize_t k)
{
    return recs_reserve(&t->held, k);
}

/* the held stamp of hinted entry ix: farthest next use first */
static inline int64_t
held_stamp(BlockTable *t, int32_t ix)
{
    return -t->nodes[t->qhead[ix]].key;
}

/* the hinted resident entry ix leaves its place to be held (room reserved) */
static void
held_add(BlockTable *t, int32_t ix)
{
    entry_detach(t, ix);
    recs_add(t, &t->held, ix, held_stamp(t, ix), HELD);
    t->holds++;
}

/* a held entry rejoins its tag's order at the most recent end */
static void
held_release(BlockTable *t, int32_t ix)
{
    aside_remove(t, ix);
    list_append(t, ix, t->entries[ix].tag);
}

/* the held entry ix is of tag `tag` now, in the same place */
static void
held_retag(BlockTable *t, int32_t ix, int tag)
{
    Entry *e = &t->entries[ix];
    t->held_n[e->tag]--;
    t->held_n[tag]++;
    if (e->ref == 0) {
        t->held_ready[e->tag]--;
        t->held_ready[tag]++;
    }
    e->tag = (uint8_t)tag;
}

/* the held records in heap order, to be read in order (see the top): made
   if they are in none, then kept for as many sifts as there are records */
static void
held_order(BlockTable *t)
{
    Aside *A = &t->held;
    if (A->keep != 0)
        return;
    A->keep = -1;
    for (int32_t pos = A->ready / 2 - 1; pos >= 0; pos--)
        heap_down(t, A, pos);
    A->keep = A->ready > MIN_ASIDE ? A->ready : MIN_ASIDE;
}

/* the next use of the held entry ix may have moved on: its place follows */
static void
held_restamp(BlockTable *t, int32_t ix)
{
    Aside *A = &t->held;
    int32_t pos = t->entries[ix].prev;
    int64_t stamp = held_stamp(t, ix);
    if (A->v[pos].stamp == stamp)
        return;
    A->v[pos].stamp = stamp;
    if (pos < A->ready) {
        heap_up(t, A, pos);
        heap_down(t, A, t->entries[ix].prev);
    }
}

/* give back the memory of records no longer needed */
static void
aside_shrink(BlockTable *t)
{
    for (int tag = 0; tag <= N_RESIDENT; tag++) {
        Aside *A = tag < N_RESIDENT ? &t->aside[tag] : &t->held;
        if (A->n == 0 && A->cap > 0) {
            PyMem_Free(A->v);
            A->v = NULL;
            A->cap = 0;
        }
        else if (A->cap > MIN_ASIDE && (int64_t)A->n * 4 < A->cap) {
            int32_t nc = A->n * 2 < MIN_ASIDE ? MIN_ASIDE : A->n * 2;
            Rec *nv = PyMem_Realloc(A->v, (size_t)nc * sizeof(Rec));
            if (nv != NULL) { /* else keep the larger array */
                A->v = nv;
                A->cap = nc;
            }
        }
    }
}

/* entry old is entry k of the new array: its queue head moves to nq[k] and
   its uses name it */
static inline void
compact_uses(BlockTable *t, int32_t *nq, int32_t old, int32_t k)
{
    if (nq == NULL)
        return;
    int32_t head = nq[k] = t->qhead[old];
    if (head < 0)
        return;
    int32_t node = head;
    do {
        t->nodes[node].ix = k;
        node = t->nodes[node].next;
    } while (node != head);
}

/* renumber the live entries into a new array of `newcap` slots (list by
   list, so lists become runs, then the entries set aside, then the held
   ones) and rebuild the index; nothing happens when memory is short */
static void
tbl_compact(BlockTable *t, int32_t newcap)
{
    int bits = bits_for(2 * (Py_ssize_t)t->used);
    size_t size = (size_t)1 << bits;
    Entry *ne = PyMem_Malloc((size_t)newcap * sizeof(Entry));
    int32_t *ni = PyMem_Malloc(size * sizeof(int32_t));
    int32_t *nq = t->qhead != NULL ? PyMem_Malloc((size_t)newcap * sizeof(int32_t)) : NULL;
    if (ne == NULL || ni == NULL || (t->qhead != NULL && nq == NULL)) {
        PyMem_Free(ne);
        PyMem_Free(ni);
        PyMem_Free(nq);
        return;
    }
    Entry *E = t->entries;
    int32_t k = 0;
    for (int L = 0; L < N_LISTS; L++) {
        List *l = &t->lists[L];
        int32_t ix = l->head, prev = -1;
        if (ix < 0)
            continue;
        l->head = k;
        while (ix >= 0) {
            int32_t nx = E[ix].next;
            ne[k] = E[ix];
            compact_uses(t, nq, ix, k);
            ne[k].prev = prev;
            ne[k].next = -1;
            if (prev >= 0)
                ne[prev].next = k;
            prev = k++;
            ix = nx;
        }
        l->tail = prev;
    }
    for (int tag = 0; tag <= N_RESIDENT; tag++) {
        Aside *A = tag < N_RESIDENT ? &t->aside[tag] : &t->held;
        for (int32_t i = 0; i < A->n; i++) {
            ne[k] = E[A->v[i].ix];
            compact_uses(t, nq, A->v[i].ix, k);
            ne[k].prev = i;
            A->v[i].ix = k++;
        }
    }
    for (int32_t ix = 0; ix < t->top && k < t->used; ix++) { /* on no list */
        if (E[ix].key != NULL && E[ix].tag == HINT_ONLY) {
            ne[k] = E[ix];
            compact_uses(t, nq, ix, k++);
        }
    }
    if (nq != NULL) {
        for (int32_t i = k; i < newcap; i++)
            nq[i] = -1;
        PyMem_Free(t->qhead);
        t->qhead = nq;
    }
    PyMem_Free(E);
    t->entries = ne;
    t->cap = newcap;
    t->top = k;
    t->free_head = -1;
    memset(ni, 0xff, size * sizeof(int32_t));
    PyMem_Free(t->index);
    t->index = ni;
    t->bits = bits;
    t->mask = size - 1;
    for (int32_t i = 0; i < k; i++)
        index_put(t, i);
}

/* give memory back after entries went away */
static void
tbl_shrink(BlockTable *t)
{
    if (t->cap > MIN_CAP && (Py_ssize_t)t->used * 4 < t->cap) {
        int32_t nc = t->used * 2;
        tbl_compact(t, nc < MIN_CAP ? MIN_CAP : nc);
    }
    else if (t->bits > MIN_BITS && (size_t)t->used * 8 < ((size_t)1 << t->bits)) {
        (void)index_rebuild(t, bits_for(2 * (Py_ssize_t)t->used));
    }
    aside_shrink(t);
}

/* ------------------------------------------------------------------------ */
/* deferred releases                                                        */

static int
trash_reserve(BlockTable *t, Py_ssize_t k)
{
    if (k <= t->trash_cap - t->ntrash)
        return 0;
    Py_ssize_t nc = t->trash_cap * 2;
    if (nc < t->ntrash + k)
        nc = t->ntrash + k;
    if (nc < 16)
        nc = 16;
    if ((size_t)nc > PY_SSIZE_T_MAX / sizeof(PyObject *)) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **nt = PyMem_Realloc(t->trash, (size_t)nc * sizeof(PyObject *));
    if (nt == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->trash = nt;
    t->trash_cap = nc;
    return 0;
}

static inline void
trash_push(BlockTable *t, PyObject *o)
{
    t->trash[t->ntrash++] = o;
}

/* release what the call dropped; in_call is clear, so a __del__ may use
   the table (and push and flush in turn: we pop one at a time) */
static void
trash_flush(BlockTable *t)
{
    while (t->ntrash > 0) {
        PyObject *o = t->trash[--t->ntrash];
        Py_DECREF(o);
    }
    if (t->trash_cap > 1024 && t->ntrash == 0) {
        PyMem_Free(t->trash);
        t->trash = NULL;
        t->trash_cap = 0;
    }
}

/* an unlinked entry that is no longer resident or a ghost: a hinted one
   stays as a hint-only entry, the others leave the index, their key to the
   trash (room reserved) */
static void
entry_forget(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    e->handle = NULL;
    e->ref = 0;
    if (qhead_of(t, ix) >= 0) {
        hint_only(t, ix);
        return;
    }
    index_del(t, ix);
    trash_push(t, e->key);
    entry_free(t, ix);
}

/* a resident entry leaves: out of its order (and the index unless it is
   hinted); its handle returned (a new reference) */
static PyObject *
drop_resident(BlockTable *t, int32_t ix)
{
    Entry *e = &t->entries[ix];
    PyObject *handle = e->handle;
    if (e->ref > 0)
        t->pinned--;
    else if (e->ref < 0)
        t->in_flight--;
    t->resident--;
    t->window_resident -= qhead_of(t, ix) >= 0;
    entry_detach(t, ix);
    entry_forget(t, ix);
    return handle;
}

/* a ghost leaves its list (trash room reserved) */
static void
drop_ghost(BlockTable *t, int32_t ix)
{
    list_unlink(t, ix);
    entry_forget(t, ix);
}

/* ------------------------------------------------------------------------ */
/* the keys of a call                                                       */

typedef struct {
    PyObject *key;  /* strong */
    PyObject *obj;  /* strong or NULL: insert's handle */
    Py_hash_t hash;
    int32_t ix;     /* its entry, -1 if none */
    int32_t tag;    /* insert's tag */
} Item;

typedef struct {
    Item *v;
    Py_ssize_t n;
    Item small[SMALL_ITEMS];
} Items;

static inline void
items_init(Items *b)
{
    b->v = NULL;
    b->n = 0;
}

/* new references to the items of `seq` (an exact list or tuple); no Python
   code runs here */
static int
items_snapshot(Items *b, PyObject *seq)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **src = PySequence_Fast_ITEMS(seq);
    if (n <= SMALL_ITEMS) {
        b->v = b->small;
    }
    else {
        if ((size_t)n > PY_SSIZE_T_MAX / sizeof(Item)) {
            PyErr_NoMemory();
            return -1;
        }
        b->v = PyMem_Malloc((size_t)n * sizeof(Item));
        if (b->v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &b->v[i];
        it->key = Py_NewRef(src[i]);
        it->obj = NULL;
        it->hash = -1;
        it->ix = -1;
        it->tag = 0;
    }
    b->n = n;
    return 0;
}

/* called with in_call clear: releasing may run Python code */
static void
items_release(Items *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Py_DECREF(b->v[i].key);
        Py_XDECREF(b->v[i].obj);
    }
    if (b->v != b->small)
        PyMem_Free(b->v);
    b->v = NULL;
    b->n = 0;
}

/* hash item i and look it up: 0, or -1 with an exception */
static inline int
item_find(BlockTable *t, Item *it)
{
    Py_hash_t h = PyObject_Hash(it->key);
    if (h == -1)
        return -1;
    it->hash = h;
    int32_t ix = tbl_find(t, it->key, h);
    if (ix == -2)
        return -1;
    it->ix = ix;
    return 0;
}

/* look up every item in order; KeyError for the first one not resident */
static int
items_resident(BlockTable *t, Items *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Item *it = &b->v[i];
        if (item_find(t, it) < 0)
            return -1;
        if (it->ix < 0 || t->entries[it->ix].tag >= N_RESIDENT) {
            raise_key(PyExc_KeyError, it->key);
            return -1;
        }
    }
    return 0;
}

/* the end of a method: clear in_call, then release what it held */
static PyObject *
leave(BlockTable *t, Items *b, PyObject *seq, PyObject *res)
{
    t->in_call = 0;
    if (b != NULL)
        items_release(b);
    Py_XDECREF(seq);
    trash_flush(t);
    return res;
}

/* ------------------------------------------------------------------------ */
/* the type: construction and destruction                                   */

static PyObject *
BT_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "BlockTable() takes no arguments");
        return NULL;
    }
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    size_t size = (size_t)1 << MIN_BITS;
    t->entries = PyMem_Malloc(MIN_CAP * sizeof(Entry));
    t->index = PyMem_Malloc(size * sizeof(int32_t));
    if (t->entries == NULL || t->index == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    memset(t->index, 0xff, size * sizeof(int32_t));
    t->cap = MIN_CAP;
    t->top = 0;
    t->used = 0;
    t->free_head = -1;
    t->bits = MIN_BITS;
    t->mask = size - 1;
    for (int L = 0; L < N_LISTS; L++) {
        t->lists[L].head = t->lists[L].tail = -1;
        t->lists[L].size = 0;
    }
    t->qhead = NULL;
    t->nodes = NULL;
    t->ncap = t->ntop = 0;
    t->nfree = -1;
    t->ring = NULL;
    t->rcap = 0;
    t->tbase = t->tnext = 1;
    t->window_requests = t->window_uses = t->window_keys = t->window_resident = 0;
    t->holds = t->window_found = 0;
    t->held.v = NULL;
    t->held.n = t->held.ready = t->held.cap = t->held.keep = 0;
    t->hold = 0;
    for (int i = 0; i < N_RESIDENT; i++) {
        t->aside[i].v = NULL;
        t->aside[i].n = t->aside[i].ready = t->aside[i].cap = 0;
        t->aside[i].keep = -1;
        t->ready_to[i] = t->in_flight_to[i] = (int8_t)i;
        t->held_n[i] = t->held_ready[i] = 0;
        t->evicted[i][0] = t->evicted[i][1] = 0;
    }
    t->late = 0;
    t->early = -1;
    t->touch_ghosts = 0;
    t->in_call = 0;
    t->trash = NULL;
    t->ntrash = t->trash_cap = 0;
    return (PyObject *)t;
}

static void
BT_dealloc(BlockTable *t)
{
    Entry *E = t->entries;
    int32_t top = t->top;
    t->entries = NULL;
    t->top = t->used = 0;
    PyMem_Free(t->index);
    t->index = NULL;
    trash_flush(t);
    PyMem_Free(t->trash);
    for (int i = 0; i < N_RESIDENT; i++)
        PyMem_Free(t->aside[i].v);
    PyMem_Free(t->held.v);
    PyMem_Free(t->qhead);
    PyMem_Free(t->nodes);
    PyMem_Free(t->ring);
    if (E != NULL) {
        for (int32_t i = 0; i < top; i++) {
            Py_XDECREF(E[i].key);
            Py_XDECREF(E[i].handle);
        }
        PyMem_Free(E);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* ------------------------------------------------------------------------ */
/* reading                                                                  */

static Py_ssize_t
BT_len(BlockTable *t)
{
    return t->resident;
}

/* the entry of one key: -1 none, -2 error */
static int32_t
find_one(BlockTable *t, PyObject *key)
{
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1)
        return -2;
    return tbl_find(t, key, h);
}

/* the resident entry with this key for a one-key reader: 1 with *ix set,
   0 when there is none (absent or a ghost), -1 with an exception set */
static int
find_resident(BlockTable *t, PyObject *key, int32_t *ix)
{
    if (t->in_call) {
        reentered();
        return -1;
    }
    t->in_call = 1;
    *ix = find_one(t, key);
    t->in_call = 0;
    if (*ix == -2)
        return -1;
    return *ix >= 0 && t->entries[*ix].tag < N_RESIDENT;
}

static PyObject *
BT_get(BlockTable *t, PyObject *key)
{
    int32_t ix;
    int r = find_resident(t, key, &ix);
    if (r < 0)
        return NULL;
    return Py_NewRef(r ? t->entries[ix].handle : Py_None);
}

static int
BT_contains(BlockTable *t, PyObject *key)
{
    int32_t ix;
    return find_resident(t, key, &ix);
}

static PyObject *
BT_ref(BlockTable *t, PyObject *key)
{
    int32_t ix;
    int r = find_resident(t, key, &ix);
    if (r < 0)
        return NULL;
    return r ? PyLong_FromLong(t->entries[ix].ref) : Py_NewRef(Py_None);
}

static PyObject *
BT_tag_of(BlockTable *t, PyObject *key)
{
    ENTER(t);
    int32_t ix = find_one(t, key);
    t->in_call = 0;
    if (ix == -2)
        return NULL;
    return PyLong_FromLong(ix < 0 || t->entries[ix].tag >= N_TAGS ? -1 : t->entries[ix].tag);
}

/* A list with value(t, ix) for each hash (ix: its entry, -1 for none),
 * every hash looked up first. value returns a new reference or NULL. */
static PyObject *
per_hash(BlockTable *t, PyObject *hashes, PyObject *(*value)(BlockTable *, int32_t))
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        return reentered();
    }
    t->in_call = 1;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    if (items_snapshot(&b, seq) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++)
        if (item_find(t, &b.v[i]) < 0)
            goto done;
    PyObject *out = PyList_New(b.n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        PyObject *v = value(t, b.v[i].ix);
        if (v == NULL) {
            Py_DECREF(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
    res = out;
done:
    return leave(t, &b, seq, res);
}

static PyObject *
tag_value(BlockTable *t, int32_t ix)
{
    /* -1..7 are cached small ints: this cannot fail */
    return PyLong_FromLong(ix < 0 || t->entries[ix].tag >= N_TAGS ? -1 : t->entries[ix].tag);
}

static PyObject *
BT_tags(BlockTable *t, PyObject *hashes)
{
    return per_hash(t, hashes, tag_value);
}

/* size(tag): in line, set aside and held */
static inline Py_ssize_t
tag_size(BlockTable *t, int tg)
{
    return t->lists[tg].size + (tg < N_RESIDENT ? t->aside[tg].n + t->held_n[tg] : 0);
}

static PyObject *
BT_size(BlockTable *t, PyObject *tag)
{
    int tg;
    if (any_tag(tag, &tg) < 0)
        return NULL;
    if (t->in_call)
        return reentered();
    return PyLong_FromSsize_t(tag_size(t, tg));
}

static PyObject *
BT_lookup(BlockTable *t, PyObject *hashes)
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        return reentered();
    }
    t->in_call = 1;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    if (items_snapshot(&b, seq) < 0)
        goto done;
    Py_ssize_t i;
    for (i = 0; i < b.n; i++) {
        if (item_find(t, &b.v[i]) < 0)
            goto done;
        int32_t ix = b.v[i].ix;
        if (ix < 0)
            break;
        Entry *e = &t->entries[ix];
        if (e->tag >= N_RESIDENT || e->ref < 0)
            break;
    }
    res = PyLong_FromSsize_t(i);
done:
    return leave(t, &b, seq, res);
}

static PyObject *
BT_absent(BlockTable *t, PyObject *hashes)
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        return reentered();
    }
    t->in_call = 1;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    if (items_snapshot(&b, seq) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (item_find(t, &b.v[i]) < 0)
            goto done;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t ix = b.v[i].ix;
        count += ix < 0 || t->entries[ix].tag >= N_RESIDENT;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0, k = 0; i < b.n; i++) {
        int32_t ix = b.v[i].ix;
        if (ix < 0 || t->entries[ix].tag >= N_RESIDENT)
            PyList_SET_ITEM(out, k++, Py_NewRef(b.v[i].key));
    }
    res = out;
done:
    return leave(t, &b, seq, res);
}

static int
by_stamp(const void *x, const void *y)
{
    int64_t a = ((const Rec *)x)->stamp, b = ((const Rec *)y)->stamp;
    return (a > b) - (a < b);
}

/* the item of entry ix for items(tag) (pairs true) or keys(tag) */
static inline PyObject *
item_of(Entry *e, int pairs)
{
    if (pairs)
        return PyTuple_Pack(2, e->key, e->handle != NULL ? e->handle : Py_None);
    return Py_NewRef(e->key);
}

/* items(tag) (pairs true) or keys(tag): the entries set aside by stamp,
   then the list */
static PyObject *
list_of_tag(BlockTable *t, PyObject *tag, int pairs)
{
    int tg;
    if (any_tag(tag, &tg) < 0)
        return NULL;
    ENTER(t);
    Py_ssize_t na = tg < N_RESIDENT ? t->aside[tg].n : 0, k = 0;
    Py_ssize_t nh = tg < N_RESIDENT ? t->held_n[tg] : 0;
    Rec *sorted = NULL;
    PyObject *out = NULL;
    if (na + nh > 0) {
        sorted = PyMem_Malloc((size_t)(na + nh) * sizeof(Rec));
        if (sorted == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (na > 0) {
            memcpy(sorted, t->aside[tg].v, (size_t)na * sizeof(Rec));
            qsort(sorted, (size_t)na, sizeof(Rec), by_stamp);
        }
        Py_ssize_t j = na;
        for (int32_t i = 0; i < t->held.n && j < na + nh; i++) {
            if (t->entries[t->held.v[i].ix].tag == tg)
                sorted[j++] = t->held.v[i];
        }
        qsort(sorted + na, (size_t)nh, sizeof(Rec), by_stamp);
    }
    out = PyList_New(na + t->lists[tg].size + nh);
    if (out == NULL)
        goto done;
    /* set aside by stamp, in line, held farthest next use first */
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *o = item_of(&t->entries[sorted[i].ix], pairs);
        if (o == NULL)
            goto fail;
        PyList_SET_ITEM(out, k++, o);
    }
    for (int32_t ix = t->lists[tg].head; ix >= 0; ix = t->entries[ix].next) {
        PyObject *o = item_of(&t->entries[ix], pairs);
        if (o == NULL)
            goto fail;
        PyList_SET_ITEM(out, k++, o);
    }
    for (Py_ssize_t i = na; i < na + nh; i++) {
        PyObject *o = item_of(&t->entries[sorted[i].ix], pairs);
        if (o == NULL)
            goto fail;
        PyList_SET_ITEM(out, k++, o);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(sorted);
    t->in_call = 0;
    return out;
}

static PyObject *
BT_items(BlockTable *t, PyObject *tag)
{
    return list_of_tag(t, tag, 1);
}

static PyObject *
BT_keys(BlockTable *t, PyObject *tag)
{
    return list_of_tag(t, tag, 0);
}

/* the entry array, the index and the records of entries set aside */
static size_t
table_bytes(BlockTable *t)
{
    size_t bytes = (size_t)t->cap * sizeof(Entry) + ((size_t)1 << t->bits) * sizeof(int32_t);
    for (int i = 0; i < N_RESIDENT; i++)
        bytes += (size_t)t->aside[i].cap * sizeof(Rec);
    bytes += (size_t)t->held.cap * sizeof(Rec) + (size_t)t->ncap * sizeof(Node) +
             (size_t)t->rcap * sizeof(Ticket);
    if (t->qhead != NULL)
        bytes += (size_t)t->cap * sizeof(int32_t);
    return bytes;
}

static PyObject *
BT_memory_bytes(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(table_bytes(t));
}

static PyObject *
BT_sizeof(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    size_t bytes = (size_t)Py_TYPE(t)->tp_basicsize + table_bytes(t) +
                   (size_t)t->trash_cap * sizeof(PyObject *);
    return PyLong_FromSize_t(bytes);
}

/* ------------------------------------------------------------------------ */
/* insert                                                                   */

/* 1 if item i equals an earlier item, 0 if not, -1 error. Small calls
   compare hashes pairwise; large ones use a scratch hash set of positions */
#define SMALL_DUP 128

typedef struct {
    int32_t *slots;
    size_t mask;
    int bits;
    int32_t small[SMALL_DUP];
} DupSet;

static int
dupset_init(DupSet *s, Py_ssize_t n)
{
    int bits = 3;
    while (((size_t)1 << bits) < (size_t)n * 2)
        bits++;
    size_t size = (size_t)1 << bits;
    if (size <= SMALL_DUP) {
        s->slots = s->small;
    }
    else if ((s->slots = PyMem_Malloc(size * sizeof(int32_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(s->slots, 0xff, size * sizeof(int32_t));
    s->mask = size - 1;
    s->bits = bits;
    return 0;
}

/* add item i, unless it equals an earlier item (1, with that item's
   position in *first if first is not NULL); 0 added, -1 error */
static int
dupset_add(DupSet *s, Item *v, int32_t i, int32_t *first)
{
    size_t k = home(v[i].hash, s->bits);
    for (;;) {
        int32_t j = s->slots[k];
        if (j < 0) {
            s->slots[k] = i;
            return 0;
        }
        if (v[j].hash == v[i].hash) {
            int r = keys_equal(v[j].key, v[i].key);
            if (r > 0 && first != NULL)
                *first = j;
            if (r != 0)
                return r;
        }
        k = (k + 1) & s->mask;
    }
}

/* phase 1 of an insert: look every item up; ValueError(h) for the first
   that is resident or repeats an earlier one. *ghosts: how many have a ghost
   entry (which the new entry replaces). Each entry found is marked ref -2
   (a ghost's or hint-only entry's ref is 0) until the check ends: keys whose
   __eq__ is not transitive, or whose __hash__ changes, can reach one entry
   from two items that the duplicate check tells apart, and committing both
   would fill that entry twice. */
static int
insert_check(BlockTable *t, Items *b, Py_ssize_t *ghosts)
{
    Py_ssize_t n = b->n, found = 0;
    DupSet dup;
    dup.slots = NULL;
    int res = -1;
    if (n > 8 && dupset_init(&dup, n) < 0)
        return -1;
    *ghosts = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &b->v[i];
        if (item_find(t, it) < 0)
            goto done;
        found = i + 1;
        if (it->ix >= 0 &&
            (t->entries[it->ix].tag < N_RESIDENT || t->entries[it->ix].ref == -2)) {
            raise_key(PyExc_ValueError, it->key);
            goto done;
        }
        int r = 0;
        if (dup.slots != NULL) {
            r = dupset_add(&dup, b->v, (int32_t)i, NULL);
        }
        else {
            for (Py_ssize_t j = 0; j < i && r == 0; j++) {
                if (b->v[j].hash == it->hash)
                    r = keys_equal(b->v[j].key, it->key);
            }
        }
        if (r < 0)
            goto done;
        if (r > 0) {
            raise_key(PyExc_ValueError, it->key);
            goto done;
        }
        if (it->ix >= 0) {
            t->entries[it->ix].ref = -2;
            *ghosts += 1;
        }
    }
    res = 0;
done:
    for (Py_ssize_t i = 0; i < found; i++) {
        int32_t ix = b->v[i].ix;
        if (ix >= 0 && t->entries[ix].ref == -2)
            t->entries[ix].ref = 0;
    }
    if (dup.slots != NULL && dup.slots != dup.small)
        PyMem_Free(dup.slots);
    return res;
}

/* make room for the checked items (-1 with MemoryError, nothing changed),
   then phase 2: each becomes a resident entry in flight at the most recent
   end of its item's tag, in order */
static int
insert_commit(BlockTable *t, Items *b, Py_ssize_t ghosts)
{
    Py_ssize_t n = b->n, hinted = 0;
    for (Py_ssize_t i = 0; t->hold && i < n; i++)
        hinted += b->v[i].ix >= 0 && qhead_of(t, b->v[i].ix) >= 0;
    /* entry numbers found by insert_check stay valid: the array may move,
       the index be rebuilt, but entries keep their numbers */
    if (tbl_reserve(t, n - ghosts) < 0 || trash_reserve(t, ghosts) < 0 ||
        held_reserve(t, hinted) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &b->v[i];
        int32_t ix = it->ix;
        Entry *e;
        if (ix >= 0) { /* a ghost (or a hint-only entry) becomes the new entry */
            e = &t->entries[ix];
            if (e->tag != HINT_ONLY)
                list_unlink(t, ix);
            trash_push(t, e->key);
            e->key = Py_NewRef(it->key);
        }
        else {
            ix = entry_alloc(t);
            e = &t->entries[ix];
            e->key = Py_NewRef(it->key);
            e->hash = it->hash;
            index_put(t, ix);
            it->ix = ix;
        }
        e->handle = Py_NewRef(it->obj);
        e->ref = -1;
        if (qhead_of(t, ix) < 0) {
            list_append(t, ix, it->tag);
            continue;
        }
        t->window_resident++;
        if (t->hold) { /* in flight: held, among the busy records */
            e->tag = (uint8_t)it->tag;
            recs_add(t, &t->held, ix, held_stamp(t, ix), HELD);
            t->holds++;
        }
        else {
            list_append(t, ix, it->tag);
        }
    }
    t->resident += n;
    t->in_flight += n;
    return 0;
}

/* `hashes` and `handles` of a call as exact lists or tuples of one length,
   NULL with an exception otherwise */
static int
insert_args(PyObject *hashes, PyObject *handles, PyObject **hs, PyObject **hd)
{
    *hs = as_seq(hashes);
    *hd = *hs == NULL ? NULL : as_seq(handles);
    if (*hd == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(*hs);
    if (n != PySequence_Fast_GET_SIZE(*hd)) {
        PyErr_Format(PyExc_ValueError, "%zd hashes but %zd handles", n,
                     PySequence_Fast_GET_SIZE(*hd));
        return -1;
    }
    return 0;
}

/* the items of `hs` with their handles from `hd` (both of b->n items,
   checked), in reverse order if `reverse` */
static int
insert_items(Items *b, PyObject *hs, PyObject *hd, int reverse)
{
    if (items_snapshot(b, hs) < 0)
        return -1;
    Py_ssize_t n = b->n;
    PyObject **hsrc = PySequence_Fast_ITEMS(hd);
    for (Py_ssize_t i = 0; i < n; i++)
        b->v[i].obj = Py_NewRef(hsrc[i]);
    for (Py_ssize_t i = 0; reverse && i < n / 2; i++) {
        Item tmp = b->v[i];
        b->v[i] = b->v[n - 1 - i];
        b->v[n - 1 - i] = tmp;
    }
    return 0;
}

static PyObject *
BT_insert(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"insert", {"hashes", "handles", "tag"}, 3, 3, 3, {NULL}};
    PyObject *a[3];
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    PyObject *hs = NULL, *hd = NULL, *tg = NULL;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    int entered = 0;

    if (insert_args(a[0], a[1], &hs, &hd) < 0)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hs);
    int single = -1;
    if (PyLong_Check(a[2])) {
        if (resident_tag(a[2], &single) < 0)
            goto fail;
    }
    else {
        tg = PySequence_List(a[2]);
        if (tg == NULL)
            goto fail;
        Py_ssize_t m = PyList_GET_SIZE(tg);
        int dummy;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (resident_tag(PyList_GET_ITEM(tg, i), &dummy) < 0)
                goto fail;
        }
        if (m != n) {
            PyErr_Format(PyExc_ValueError, "%zd hashes but %zd tags", n, m);
            goto fail;
        }
    }
    if (t->in_call) {
        reentered();
        goto fail;
    }
    t->in_call = 1;
    entered = 1;
    /* hs, hd and tg are ours or exact lists/tuples: nothing has run
       Python code since their lengths were read */
    if (n != PySequence_Fast_GET_SIZE(hs) || n != PySequence_Fast_GET_SIZE(hd) ||
        (tg != NULL && n != PyList_GET_SIZE(tg))) {
        PyErr_SetString(PyExc_RuntimeError, "insert(): arguments changed size");
        goto fail;
    }
    if (insert_items(&b, hs, hd, 0) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (tg != NULL) {
            long v;
            (void)int_in(PyList_GET_ITEM(tg, i), 0, N_RESIDENT, &v);
            b.v[i].tag = (int32_t)v;
        }
        else {
            b.v[i].tag = single;
        }
    }
    Py_ssize_t ghosts;
    if (insert_check(t, &b, &ghosts) < 0 || insert_commit(t, &b, ghosts) < 0)
        goto fail;
    res = Py_NewRef(Py_None);
fail:
    if (entered) {
        res = leave(t, &b, hs, res);
    }
    else {
        items_release(&b);
        Py_XDECREF(hs);
    }
    Py_XDECREF(hd);
    Py_XDECREF(tg);
    return res;
}

static PyObject *
BT_insert_chain(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {
        "insert_chain", {"hashes", "handles", "tag", "readmit"}, 4, 4, 4, {NULL}};
    PyObject *a[4];
    int tag, readmit;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    if (resident_tag(a[2], &tag) < 0 || resident_tag(a[3], &readmit) < 0)
        return NULL;
    PyObject *hs = NULL, *hd = NULL;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    int entered = 0;
    if (insert_args(a[0], a[1], &hs, &hd) < 0)
        goto fail;
    if (t->in_call) {
        reentered();
        goto fail;
    }
    t->in_call = 1;
    entered = 1;
    /* insert(reversed(hashes), reversed(handles), tags): the head ends most
       recent */
    if (insert_items(&b, hs, hd, 1) < 0)
        goto fail;
    Py_ssize_t ghosts, n = b.n;
    if (insert_check(t, &b, &ghosts) < 0)
        goto fail;
    /* insert_check let no resident entry through: one found is a ghost or
       hint-only */
    Py_ssize_t nmet = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t ix = b.v[i].ix;
        int ghost = ix >= 0 && t->entries[ix].tag < N_TAGS;
        b.v[i].tag = ghost ? readmit : tag;
        nmet += ghost;
    }
    int32_t last = n > 0 ? b.v[0].ix : -1; /* the last hash */
    int cold = n > 0 && (last < 0 || t->entries[last].tag >= N_TAGS); /* no ghost */
    PyObject *met = NULL;
    if (nmet > 0 && (met = PyList_New(nmet)) == NULL)
        goto fail;
    for (Py_ssize_t i = n - 1, k = 0; met != NULL && i >= 0; i--) {
        int32_t ix = b.v[i].ix;
        if (ix >= 0 && t->entries[ix].tag < N_TAGS) /* cached small ints: cannot fail */
            PyList_SET_ITEM(met, k++, PyLong_FromLong(t->entries[ix].tag));
    }
    if ((cold && aside_reserve(t, tag, 1) < 0) || insert_commit(t, &b, ghosts) < 0) {
        Py_XDECREF(met);
        goto fail;
    }
    int32_t tail = n > 0 ? b.v[0].ix : -1;
    if (cold && t->entries[tail].place != HELD) {
        /* to the oldest end of its tag, as move(h, tag, last=False) */
        entry_detach(t, tail);
        aside_add(t, tail, tag, t->early--);
    }
    res = met != NULL ? met : Py_NewRef(Py_None);
fail:
    if (entered) {
        res = leave(t, &b, hs, res);
    }
    else {
        items_release(&b);
        Py_XDECREF(hs);
    }
    Py_XDECREF(hd);
    return res;
}

/* ------------------------------------------------------------------------ */
/* complete, fail, pin, unpin                                               */

/* the common start: `hashes` as a snapshot, in_call set, every hash
   resident (KeyError for the first that is not). Returns the sequence (to
   hand to leave()) or NULL (in_call clear again) */
static PyObject *
begin_resident(BlockTable *t, PyObject *hashes, Items *b)
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        reentered();
        return NULL;
    }
    t->in_call = 1;
    if (items_snapshot(b, seq) < 0 || items_resident(t, b) < 0) {
        leave(t, b, seq, NULL);
        return NULL;
    }
    return seq;
}

/* distinct in-flight entries among the items (marks ref -2, then undoes) */
static Py_ssize_t
count_in_flight(BlockTable *t, Items *b)
{
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Entry *e = &t->entries[b->v[i].ix];
        if (e->ref == -1) {
            e->ref = -2;
            count++;
        }
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Entry *e = &t->entries[b->v[i].ix];
        if (e->ref == -2)
            e->ref = -1;
    }
    return count;
}

static PyObject *
BT_complete(BlockTable *t, PyObject *hashes)
{
    Items b;
    items_init(&b);
    PyObject *seq = begin_resident(t, hashes, &b);
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(count_in_flight(t, &b));
    if (out != NULL) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < b.n; i++) {
            Entry *e = &t->entries[b.v[i].ix];
            if (e->ref == -1) {
                e->ref = 0;
                t->in_flight--;
                if (e->place != IN_LINE)
                    aside_ready(t, b.v[i].ix);
                PyList_SET_ITEM(out, k++, Py_NewRef(b.v[i].key));
            }
        }
    }
    return leave(t, &b, seq, out);
}

static PyObject *
BT_fail(BlockTable *t, PyObject *hashes)
{
    Items b;
    items_init(&b);
    PyObject *seq = begin_resident(t, hashes, &b);
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = count_in_flight(t, &b);
    PyObject *out = NULL;
    if (trash_reserve(t, count) == 0)
        out = PyList_New(count);
    if (out != NULL) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < b.n; i++) {
            int32_t ix = b.v[i].ix;
            Entry *e = &t->entries[ix];
            /* a slot freed earlier in this loop has no key */
            if (e->key != NULL && e->ref == -1)
                PyList_SET_ITEM(out, k++, drop_resident(t, ix));
        }
        tbl_shrink(t);
    }
    return leave(t, &b, seq, out);
}

static PyObject *
BT_pin(BlockTable *t, PyObject *hashes)
{
    Items b;
    items_init(&b);
    PyObject *seq = begin_resident(t, hashes, &b);
    if (seq == NULL)
        return NULL;
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        Entry *e = &t->entries[b.v[i].ix];
        if (e->ref < 0) {
            raise_key(PyExc_ValueError, b.v[i].key);
            goto done;
        }
        if (e->ref > INT32_MAX - b.n) {
            PyErr_SetString(PyExc_OverflowError, "pin(): reference count too large");
            goto done;
        }
    }
    out = PyList_New(b.n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        Entry *e = &t->entries[b.v[i].ix];
        if (e->ref++ == 0) {
            t->pinned++;
            if (e->place != IN_LINE)
                aside_busy(t, b.v[i].ix);
        }
        PyList_SET_ITEM(out, i, Py_NewRef(e->handle));
    }
done:
    return leave(t, &b, seq, out);
}

static PyObject *
BT_unpin(BlockTable *t, PyObject *hashes)
{
    Items b;
    items_init(&b);
    PyObject *seq = begin_resident(t, hashes, &b);
    if (seq == NULL)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = b.n;
    if (n > INT32_MAX / 2) {
        PyErr_SetString(PyExc_OverflowError, "unpin(): too many hashes");
        goto done;
    }
    /* take every occurrence off tentatively: an entry below 0 was named
       more times than its ref; the first position showing one is the first
       occurrence of the first such hash */
    for (Py_ssize_t i = 0; i < n; i++)
        t->entries[b.v[i].ix].ref--;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (t->entries[b.v[i].ix].ref < 0) {
            bad = i;
            break;
        }
    }
    /* undo, backwards: the first time an entry is seen is its last
       occurrence, where it shows its final ref */
    Py_ssize_t released = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Entry *e = &t->entries[b.v[i].ix];
        released += e->ref == 0;
        e->ref++;
    }
    if (bad >= 0) {
        raise_key(PyExc_ValueError, b.v[bad].key);
        goto done;
    }
    out = PyList_New(released);
    if (out == NULL)
        goto done;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t ix = b.v[i].ix;
        Entry *e = &t->entries[ix];
        if (--e->ref == 0) {
            t->pinned--;
            PyList_SET_ITEM(out, k++, Py_NewRef(b.v[i].key));
            if (e->place != IN_LINE)
                aside_ready(t, ix);
        }
    }
done:
    return leave(t, &b, seq, out);
}

/* ------------------------------------------------------------------------ */
/* remove, move, relist, trim, forget_policy                                */

static PyObject *
BT_remove(BlockTable *t, PyObject *key)
{
    ENTER(t);
    PyObject *res = NULL;
    int32_t ix = find_one(t, key);
    if (ix == -2)
        goto done;
    if (ix < 0 || t->entries[ix].tag >= N_RESIDENT) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    if (trash_reserve(t, 1) < 0)
        goto done;
    res = drop_resident(t, ix);
    tbl_shrink(t);
done:
    return leave(t, NULL, NULL, res);
}

static PyObject *
BT_move(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"move", {"h", "tag", "last"}, 2, 3, 3, {NULL}};
    PyObject *a[3];
    int tag;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    if (resident_tag(a[1], &tag) < 0)
        return NULL;
    ENTER(t);
    int32_t ix = find_one(t, a[0]);
    if (ix == -2)
        goto fail;
    if (ix < 0 || t->entries[ix].tag >= N_RESIDENT) {
        raise_key(PyExc_KeyError, a[0]);
        goto fail;
    }
    int last = a[2] == NULL ? 1 : PyObject_IsTrue(a[2]);
    if (last < 0)
        goto fail;
    if (t->entries[ix].place == HELD) { /* held: only its tag changes */
        held_retag(t, ix, tag);
        t->in_call = 0;
        Py_RETURN_NONE;
    }
    if (!last && aside_reserve(t, tag, 1) < 0)
        goto fail;
    entry_detach(t, ix);
    if (last)
        list_append(t, ix, tag);
    else /* the oldest end: set aside before every entry there */
        aside_add(t, ix, tag, t->early--);
    t->in_call = 0;
    Py_RETURN_NONE;
fail:
    t->in_call = 0;
    return NULL;
}

static PyObject *
BT_relist(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"relist", {"hashes", "tag"}, 2, 2, 2, {NULL}};
    PyObject *a[2];
    int tag;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    if (resident_tag(a[1], &tag) < 0)
        return NULL;
    Items b;
    items_init(&b);
    PyObject *seq = begin_resident(t, a[0], &b);
    if (seq == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        int32_t ix = b.v[i].ix;
        if (t->entries[ix].place == HELD) {
            held_retag(t, ix, tag);
            continue;
        }
        entry_detach(t, ix);
        list_append(t, ix, tag);
    }
    return leave(t, &b, seq, Py_NewRef(Py_None));
}

/* drop the oldest ghosts of ghost tag `tag` until `keep` remain */
static Py_ssize_t
drop_ghosts(BlockTable *t, int tag, Py_ssize_t keep)
{
    List *l = &t->lists[tag];
    Py_ssize_t dropped = 0;
    while (l->size > keep) {
        drop_ghost(t, l->head);
        dropped++;
    }
    return dropped;
}

/* phase 1 of turning hint order off: the held records, farthest next use
   first, in *sorted (NULL when there are none); -1 with MemoryError */
static int
unhold_prepare(BlockTable *t, Rec **sorted)
{
    *sorted = NULL;
    Aside *A = &t->held;
    if (A->n == 0)
        return 0;
    *sorted = PyMem_Malloc((size_t)A->n * sizeof(Rec));
    if (*sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(*sorted, A->v, (size_t)A->n * sizeof(Rec));
    qsort(*sorted, (size_t)A->n, sizeof(Rec), by_stamp);
    return 0;
}

/* phase 2: hint order off; every held entry rejoins its tag's order at the
   most recent end, farthest next use first (the nearest ends most recent) */
static void
unhold(BlockTable *t, Rec *sorted)
{
    int32_t n = t->held.n;
    for (int32_t i = 0; i < n; i++)
        held_release(t, sorted[i].ix);
    PyMem_Free(sorted);
    t->hold = 0;
}

static PyObject *
BT_forget_policy(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    ENTER(t);
    Py_ssize_t ghosts = 0;
    for (int tag = N_RESIDENT; tag < N_TAGS; tag++)
        ghosts += t->lists[tag].size;
    PyObject *res = NULL;
    Rec *sorted;
    if (trash_reserve(t, ghosts) == 0 && unhold_prepare(t, &sorted) == 0) {
        for (int tag = N_RESIDENT; tag < N_TAGS; tag++)
            drop_ghosts(t, tag, 0);
        for (int i = 0; i < N_RESIDENT; i++)
            t->ready_to[i] = t->in_flight_to[i] = (int8_t)i;
        t->touch_ghosts = 0;
        unhold(t, sorted);
        tbl_shrink(t);
        res = Py_NewRef(Py_None);
    }
    return leave(t, NULL, NULL, res);
}

static PyObject *
BT_trim(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"trim", {"tag", "keep"}, 2, 2, 2, {NULL}};
    PyObject *a[2];
    int tg;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    if (ghost_tag(a[0], &tg) < 0)
        return NULL;
    Py_ssize_t keep = -1;
    if (PyLong_CheckExact(a[1])) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(a[1], &overflow);
        keep = overflow > 0 || v > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX
               : overflow < 0 || v < 0          ? -1
                                                : (Py_ssize_t)v;
    }
    if (keep < 0) {
        PyErr_Format(PyExc_ValueError, "keep must be an int >= 0, got %R", a[1]);
        return NULL;
    }
    ENTER(t);
    PyObject *res = NULL;
    Py_ssize_t size = t->lists[tg].size;
    if (trash_reserve(t, size > keep ? size - keep : 0) == 0) {
        Py_ssize_t dropped = drop_ghosts(t, tg, keep);
        tbl_shrink(t);
        res = PyLong_FromSsize_t(dropped); /* after the drop: cannot undo */
    }
    return leave(t, NULL, NULL, res);
}

/* ------------------------------------------------------------------------ */
/* touch                                                                    */

/* kvoffload.table.TouchRules, imported when first needed (kvoffload.table
   imports this module) */
static PyObject *touch_rules_type;

/* where a block of each list goes: rules.<name>.get(list, list) for each
   resident list, each in [lo, 3] */
static int
read_moves(PyObject *rules, const char *name, int lo, int8_t out[N_RESIDENT])
{
    PyObject *m = PyObject_GetAttrString(rules, name);
    if (m == NULL)
        return -1;
    for (int i = 0; i < N_RESIDENT; i++) {
        PyObject *dest = PyObject_CallMethod(m, "get", "(ii)", i, i);
        if (dest == NULL) {
            Py_DECREF(m);
            return -1;
        }
        long v = 0;
        int r = int_in(dest, lo, N_RESIDENT, &v);
        if (r > 0)
            PyErr_Format(PyExc_ValueError, "TouchRules.%s sends list %d to %R", name, i, dest);
        Py_DECREF(dest);
        if (r != 0) {
            Py_DECREF(m);
            return -1;
        }
        out[i] = (int8_t)v;
    }
    Py_DECREF(m);
    return 0;
}

static PyObject *
BT_set_touch_rules(BlockTable *t, PyObject *rules)
{
    if (touch_rules_type == NULL) {
        PyObject *mod = PyImport_ImportModule("kvoffload.table");
        if (mod == NULL)
            return NULL;
        touch_rules_type = PyObject_GetAttrString(mod, "TouchRules");
        Py_DECREF(mod);
        if (touch_rules_type == NULL)
            return NULL;
    }
    int is = PyObject_IsInstance(rules, touch_rules_type);
    if (is < 0)
        return NULL;
    if (!is) {
        PyErr_Format(PyExc_TypeError, "set_touch_rules() takes a TouchRules, got %R", rules);
        return NULL;
    }
    int8_t ready[N_RESIDENT], flying[N_RESIDENT];
    if (read_moves(rules, "ready", 0, ready) < 0 || read_moves(rules, "in_flight", -1, flying) < 0)
        return NULL;
    PyObject *g = PyObject_GetAttrString(rules, "ghosts");
    if (g == NULL)
        return NULL;
    int ghosts = PyObject_IsTrue(g);
    Py_DECREF(g);
    if (ghosts < 0)
        return NULL;
    ENTER(t);
    memcpy(t->ready_to, ready, sizeof ready);
    memcpy(t->in_flight_to, flying, sizeof flying);
    t->touch_ghosts = (char)ghosts;
    t->in_call = 0;
    Py_RETURN_NONE;
}

static PyObject *
BT_touch(BlockTable *t, PyObject *hashes)
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        return reentered();
    }
    t->in_call = 1;
    Items b;
    items_init(&b);
    PyObject *res = NULL;
    if (items_snapshot(&b, seq) < 0)
        goto done;
    /* visiting order is last to first; look up in that order too */
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = b.n - 1; i >= 0; i--) {
        if (item_find(t, &b.v[i]) < 0)
            goto done;
        int32_t ix = b.v[i].ix;
        hits += ix >= 0 && t->entries[ix].tag >= N_RESIDENT && t->entries[ix].tag < N_TAGS;
    }
    PyObject *out = NULL;
    if (t->touch_ghosts && hits > 0) {
        out = PyList_New(hits);
        if (out == NULL)
            goto done;
    }
    Py_ssize_t k = 0;
    Entry *E = t->entries;
    for (Py_ssize_t i = b.n - 1; i >= 0; i--) {
        int32_t ix = b.v[i].ix;
        if (ix < 0)
            continue;
        Entry *e = &E[ix];
        int tag = e->tag;
        int dest;
        if (tag >= N_RESIDENT) {
            if (out == NULL || tag >= N_TAGS)
                continue;
            list_unlink(t, ix);
            list_append(t, ix, tag);
            PyList_SET_ITEM(out, k++, PyLong_FromLong(tag)); /* cached small int */
        }
        else {
            dest = e->ref >= 0 ? t->ready_to[tag] : t->in_flight_to[tag];
            if (dest < 0)
                continue;
            if (e->place == HELD) {
                held_retag(t, ix, dest);
                continue;
            }
            entry_detach(t, ix);
            list_append(t, ix, dest);
        }
    }
    res = out != NULL ? out : Py_NewRef(Py_None);
done:
    return leave(t, &b, seq, res);
}

/* ------------------------------------------------------------------------ */
/* evict                                                                    */

/* what a walk found: an in-line entry to set aside (busy or protected) or a
   victim */
enum { W_ASIDE, W_VICTIM };

typedef struct {
    int32_t ix;
    uint8_t kind;
    uint8_t side; /* 0: list a, 1: list b */
} Walk;

typedef struct {
    Walk *v;
    Py_ssize_t n, cap;
    Walk small[SMALL_WALK];
} Walks;

/* a growable array on the stack first; 0, or -1 with MemoryError */
static int
grow(void **v, void *small, Py_ssize_t *cap, size_t item)
{
    Py_ssize_t nc = *cap * 2;
    void *nv;
    if ((size_t)nc > PY_SSIZE_T_MAX / item) {
        PyErr_NoMemory();
        return -1;
    }
    if (*v == small) {
        nv = PyMem_Malloc((size_t)nc * item);
        if (nv != NULL)
            memcpy(nv, small, (size_t)*cap * item);
    }
    else {
        nv = PyMem_Realloc(*v, (size_t)nc * item);
    }
    if (nv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *v = nv;
    *cap = nc;
    return 0;
}

static int
walks_push(Walks *w, int32_t ix, int kind, int side)
{
    if (w->n == w->cap && grow((void **)&w->v, w->small, &w->cap, sizeof(Walk)) < 0)
        return -1;
    Walk *x = &w->v[w->n++];
    x->ix = ix;
    x->kind = (uint8_t)kind;
    x->side = (uint8_t)side;
    return 0;
}

/* One list's walk: first the ready entries set aside, in stamp order, read
   from the heap without changing it (`front` is a min-heap of the heap
   positions whose parents were read: the next one is the smallest), then
   the entries in line from `cur`. */
typedef struct {
    int tag;
    int32_t cur;
    Py_ssize_t found; /* victims from this list */
    Py_ssize_t aside; /* in-line entries it sets aside */
    int32_t *front;
    Py_ssize_t nfront, capfront;
    int32_t small[SMALL_FRONT];
} Side;

/* a walk from `cur` (-1: none), its set-aside records in A */
static void
side_start(Side *s, int tag, int32_t cur, const Aside *A)
{
    s->tag = tag;
    s->cur = cur;
    s->found = s->aside = 0;
    s->front = s->small;
    s->capfront = SMALL_FRONT;
    s->nfront = A->ready > 0;
    s->small[0] = 0;
}

static void
side_init(BlockTable *t, Side *s, int tag)
{
    side_start(s, tag, t->lists[tag].head, &t->aside[tag]);
}

static void
side_free(Side *s)
{
    if (s->front != s->small)
        PyMem_Free(s->front);
}

static int
front_push(Side *s, const Rec *v, int32_t pos)
{
    if (s->nfront == s->capfront &&
        grow((void **)&s->front, s->small, &s->capfront, sizeof(int32_t)) < 0)
        return -1;
    Py_ssize_t i = s->nfront++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (v[s->front[parent]].stamp < v[pos].stamp)
            break;
        s->front[i] = s->front[parent];
        i = parent;
    }
    s->front[i] = pos;
    return 0;
}

static int32_t
front_pop(Side *s, const Rec *v)
{
    int32_t top = s->front[0], last = s->front[--s->nfront];
    Py_ssize_t i = 0, n = s->nfront;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && v[s->front[c + 1]].stamp < v[s->front[c]].stamp)
            c++;
        if (v[last].stamp < v[s->front[c]].stamp)
            break;
        s->front[i] = s->front[c];
        i = c;
    }
    if (n > 0)
        s->front[i] = last;
    return top;
}

enum { P_EMPTY, P_SET, P_DICT, P_ANY };

/* 1 if key is in the protected container, 0 if not, -1 error */
static inline int
is_protected(PyObject *prot, int pmode, PyObject *key)
{
    switch (pmode) {
    case P_EMPTY:
        return 0;
    case P_SET:
        return PySet_Contains(prot, key);
    case P_DICT:
        return PyDict_Contains(prot, key);
    default:
        return PySequence_Contains(prot, key);
    }
}

/* walk a list on until `*found` reaches `want`, recording the victims and
   the in-line entries to set aside. 0, or -1 with an exception */
static int
walk_list(BlockTable *t, Side *s, int side, Py_ssize_t want, Py_ssize_t *found, Walks *w,
          PyObject *prot, int pmode)
{
    const Aside *A = &t->aside[s->tag];
    while (*found < want && s->nfront > 0) {
        int32_t pos = front_pop(s, A->v);
        for (int32_t c = 2 * pos + 1; c <= 2 * pos + 2 && c < A->ready; c++) {
            if (front_push(s, A->v, c) < 0)
                return -1;
        }
        int32_t ix = A->v[pos].ix;
        t->walked++;
        int r = is_protected(prot, pmode, t->entries[ix].key);
        if (r < 0)
            return -1;
        if (r > 0)
            continue; /* protected: stays where it is */
        if (walks_push(w, ix, W_VICTIM, side) < 0)
            return -1;
        (*found)++;
        s->found++;
    }
    while (*found < want && s->cur >= 0) {
        int32_t ix = s->cur;
        Entry *e = &t->entries[ix];
        t->walked++;
        s->cur = e->next;
        int kind = W_ASIDE;
        if (e->ref == 0) {
            int r = is_protected(prot, pmode, e->key);
            if (r < 0)
                return -1;
            if (r == 0)
                kind = W_VICTIM;
        }
        if (walks_push(w, ix, kind, side) < 0)
            return -1;
        if (kind == W_VICTIM) {
            (*found)++;
            s->found++;
        }
        else {
            s->aside++;
        }
    }
    return 0;
}

/* the held walk: the ready held entries of tags ta and tb (-1: none),
   farthest next use first, read from the held heap as walk_list reads the
   entries set aside; victims are recorded as side 2 */
static int
walk_held(BlockTable *t, Side *s, int ta, int tb, Py_ssize_t want, Py_ssize_t *found, Walks *w,
          PyObject *prot, int pmode)
{
    const Aside *A = &t->held;
    while (*found < want && s->nfront > 0) {
        int32_t pos = front_pop(s, A->v);
        for (int32_t c = 2 * pos + 1; c <= 2 * pos + 2 && c < A->ready; c++) {
            if (front_push(s, A->v, c) < 0)
                return -1;
        }
        int32_t ix = A->v[pos].ix;
        int tag = t->entries[ix].tag;
        if (tag != ta && tag != tb)
            continue;
        t->walked++;
        int r = is_protected(prot, pmode, t->entries[ix].key);
        if (r < 0)
            return -1;
        if (r > 0)
            continue;
        if (walks_push(w, ix, W_VICTIM, 2) < 0)
            return -1;
        (*found)++;
        s->found++;
    }
    return 0;
}

/* a walk of the held heap from its top */
static void
side_init_held(BlockTable *t, Side *s)
{
    side_start(s, -1, -1, &t->held);
}

/* how `protected` is searched */
static int
protection_mode(PyObject *prot)
{
    if (PyAnySet_CheckExact(prot))
        return PySet_GET_SIZE(prot) == 0 ? P_EMPTY : P_SET;
    if (PyDict_CheckExact(prot))
        return PyDict_GET_SIZE(prot) == 0 ? P_EMPTY : P_DICT;
    return P_ANY;
}

/* `o` is absent or None (*out -1), or a tag `parse` accepts */
static int
optional_tag(PyObject *o, int (*parse)(PyObject *, int *), int *out)
{
    *out = -1;
    return o == NULL || o == Py_None ? 0 : parse(o, out);
}

/* evict's `target` (a number other than a bool, finite; not with `first`) */
static int
parse_target(PyObject *o, int with_first, double *out)
{
    if (with_first) {
        PyErr_SetString(PyExc_TypeError, "evict() takes first or target, not both");
        return -1;
    }
    if (!PyFloat_Check(o) && !(PyLong_Check(o) && !PyBool_Check(o))) {
        PyErr_Format(PyExc_TypeError, "target must be a number or None, got %R", o);
        return -1;
    }
    *out = PyFloat_AsDouble(o); /* runs no Python code for a float or an int */
    if (*out == -1.0 && PyErr_Occurred())
        return -1;
    if (!isfinite(*out)) {
        PyErr_Format(PyExc_ValueError, "target must be finite, got %R", o);
        return -1;
    }
    return 0;
}

/* evict's `trim`: an int >= 0 */
static int
parse_trim(PyObject *o, Py_ssize_t *out)
{
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "trim must be an int or None, got %R", o);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (overflow == 0 && v < 0)) {
        PyErr_Format(PyExc_ValueError, "trim must be >= 0, got %R", o);
        return -1;
    }
    *out = overflow > 0 || v > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : (Py_ssize_t)v;
    return 0;
}

/* the ghosts trim_ghosts may drop once n victims joined ghost tags ga and
   gb (-1: none): trash room for them */
static Py_ssize_t
trim_room(BlockTable *t, int ga, int gb, Py_ssize_t n, Py_ssize_t trim)
{
    Py_ssize_t room = 0;
    int g[2] = {ga, gb};
    for (int i = 0; i < 2; i++) {
        if (g[i] < 0 || (i == 1 && gb == ga))
            continue;
        Py_ssize_t most = t->lists[g[i]].size + n;
        if (most - trim > trim)
            room += most - trim;
    }
    return room;
}

/* a ghost list that grew past twice `trim` loses its oldest down to
   `trim` (trash room reserved): in batches, so that an eviction only looks
   at the sizes, and a list that keeps growing is trimmed once every `trim`
   victims or so */
static void
trim_ghosts(BlockTable *t, int ga, int gb, Py_ssize_t trim)
{
    int g[2] = {ga, gb};
    for (int i = 0; i < 2; i++) {
        if (g[i] < 0 || (i == 1 && gb == ga))
            continue;
        if (t->lists[g[i]].size - trim > trim)
            (void)drop_ghosts(t, g[i], trim);
    }
}

/* the count `n` (an exact int): ValueError below 0; above MAX_ENTRIES it is
   MAX_ENTRIES + 1, more than any table holds */
static int
count_of(PyObject *v, Py_ssize_t *out)
{
    int over;
    long long n = PyLong_AsLongLongAndOverflow(v, &over);
    if (over < 0 || (!over && n < 0)) {
        PyErr_Format(PyExc_ValueError, "n must be >= 0, got %R", v);
        return -1;
    }
    *out = over || n > MAX_ENTRIES ? (Py_ssize_t)MAX_ENTRIES + 1 : (Py_ssize_t)n;
    return 0;
}

static PyObject *
BT_evict(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"evict",
                      {"a", "n", "protected", "b", "first", "ghost_a", "ghost_b", "spill",
                       "target", "trim"},
                      3,
                      3,
                      10,
                      {NULL}};
    PyObject *a[10];
    int ta, tb, ga, gb;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0)
        return NULL;
    if (resident_tag(a[0], &ta) < 0 || optional_tag(a[3], resident_tag, &tb) < 0)
        return NULL;
    if (tb == ta) {
        PyErr_Format(PyExc_ValueError, "a and b must be different lists, got %d twice", ta);
        return NULL;
    }
    if (optional_tag(a[5], ghost_tag, &ga) < 0 || optional_tag(a[6], ghost_tag, &gb) < 0)
        return NULL;
    if (!PyLong_CheckExact(a[1])) {
        PyErr_Format(PyExc_TypeError, "n must be an int, got %R", a[1]);
        return NULL;
    }
    if (a[4] != NULL && a[4] != Py_None && !PyLong_CheckExact(a[4])) {
        PyErr_Format(PyExc_TypeError, "first must be an int or None, got %R", a[4]);
        return NULL;
    }
    /* more than a table can hold: no room (None below), as in the reference */
    Py_ssize_t n;
    if (count_of(a[1], &n) < 0)
        return NULL;
    Py_ssize_t first = n;
    if (a[4] != NULL && a[4] != Py_None) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(a[4], &overflow);
        /* a negative first walks a for nothing first, as min(first, n) does */
        first = overflow > 0 || v > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX
                : overflow < 0 || v < 0          ? 0
                                                 : (Py_ssize_t)v;
        if (first > n)
            first = n;
    }
    double target = 0.0;
    int has_target = a[8] != NULL && a[8] != Py_None;
    if (has_target && parse_target(a[8], a[4] != NULL && a[4] != Py_None, &target) < 0)
        return NULL;
    Py_ssize_t trim = -1;
    if (a[9] != NULL && a[9] != Py_None && parse_trim(a[9], &trim) < 0)
        return NULL;
    int spill = a[7] == NULL ? 0 : PyObject_IsTrue(a[7]);
    if (spill < 0)
        return NULL;
    PyObject *prot = a[2];
    ENTER(t);
    if (has_target) {
        /* int(size(a) + n - target), as Python computes it (a double), in 0..n */
        double v = (double)(tag_size(t, ta) + n) - target;
        first = v <= 0.0 ? 0 : v >= (double)n ? n : (Py_ssize_t)v;
    }

    Walks w;
    w.v = w.small;
    w.n = 0;
    w.cap = SMALL_WALK;
    Side sides[3]; /* a, b, held */
    int nsides = tb < 0 ? 1 : 2;
    side_init(t, &sides[0], ta);
    if (tb >= 0)
        side_init(t, &sides[1], tb);
    side_init_held(t, &sides[2]);
    PyObject *res = NULL;
    PyObject *hashes = NULL, *handles = NULL, *na_obj = NULL;
    if (n == 0) {
        res = Py_BuildValue("([][]i)", 0);
        goto done;
    }
    /* more than could be victims: the entries in line and the ready ones set
       aside (and held, to spill to) */
    Py_ssize_t room = 0;
    for (int s = 0; s < nsides; s++) {
        int tag = sides[s].tag;
        room += t->lists[tag].size + t->aside[tag].ready + (spill ? t->held_ready[tag] : 0);
    }
    if (n > room) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    int pmode = protection_mode(prot);
    Py_ssize_t found = 0;
    if (walk_list(t, &sides[0], 0, first, &found, &w, prot, pmode) < 0)
        goto done;
    if (tb >= 0 && walk_list(t, &sides[1], 1, n, &found, &w, prot, pmode) < 0)
        goto done;
    if (walk_list(t, &sides[0], 0, n, &found, &w, prot, pmode) < 0)
        goto done;
    if (spill && found < n) {
        held_order(t);
        if (walk_held(t, &sides[2], ta, tb, n, &found, &w, prot, pmode) < 0)
            goto done;
    }
    if (found < n) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    for (int s = 0; s < nsides; s++) {
        if (aside_reserve(t, sides[s].tag, sides[s].aside) < 0)
            goto done;
    }
    if (trim >= 0 && trash_reserve(t, trim_room(t, ga, gb, n, trim)) < 0)
        goto done;
    hashes = PyList_New(n);
    handles = PyList_New(n);
    na_obj = PyLong_FromSsize_t(sides[0].found);
    res = PyTuple_New(3);
    if (hashes == NULL || handles == NULL || na_obj == NULL || res == NULL) {
        Py_CLEAR(res);
        goto done;
    }

    /* phase 2: list a's walk, then list b's (each in walking order, so the
       entries set aside get stamps in their order), then the held victims */
    Py_ssize_t pos = 0;
    for (int side = 0; side < 3; side++) {
        for (Py_ssize_t i = 0; i < w.n; i++) {
            if (w.v[i].side != side)
                continue;
            int32_t ix = w.v[i].ix;
            Entry *e = &t->entries[ix];
            int g = (side == 2 ? e->tag == ta : side == 0) ? ga : gb;
            entry_detach(t, ix);
            if (w.v[i].kind == W_ASIDE) {
                aside_add(t, ix, sides[side].tag, t->late++);
                continue;
            }
            t->evicted[e->tag][side == 2]++;
            /* a victim: its handle goes to the result, and its key unless
               the entry stays (a ghost, or hint-only) */
            PyList_SET_ITEM(handles, pos, e->handle);
            e->handle = NULL;
            int hinted = qhead_of(t, ix) >= 0;
            t->window_resident -= hinted;
            if (g >= 0 || hinted) {
                PyList_SET_ITEM(hashes, pos, Py_NewRef(e->key));
                if (g >= 0)
                    list_append(t, ix, g);
                else
                    hint_only(t, ix);
            }
            else {
                PyList_SET_ITEM(hashes, pos, e->key);
                index_del(t, ix);
                entry_free(t, ix);
            }
            pos++;
        }
    }
    t->resident -= n;
    if (trim >= 0)
        trim_ghosts(t, ga, gb, trim);
    PyTuple_SET_ITEM(res, 0, hashes);
    PyTuple_SET_ITEM(res, 1, handles);
    PyTuple_SET_ITEM(res, 2, na_obj);
    hashes = handles = na_obj = NULL;
    tbl_shrink(t);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(handles);
    Py_XDECREF(na_obj);
    if (w.v != w.small)
        PyMem_Free(w.v);
    for (int s = 0; s < nsides; s++)
        side_free(&sides[s]);
    side_free(&sides[2]);
    return leave(t, NULL, NULL, res);
}

/* ------------------------------------------------------------------------ */
/* the hint window                                                          */

/* room for k more uses */
static int
nodes_reserve(BlockTable *t, Py_ssize_t k)
{
    if (k <= (Py_ssize_t)t->ncap - t->window_uses)
        return 0;
    if (k > (Py_ssize_t)MAX_ENTRIES - t->window_uses) {
        PyErr_SetString(PyExc_OverflowError, "a BlockTable's window holds at most 2**31 - 2 uses");
        return -1;
    }
    Py_ssize_t nc = (Py_ssize_t)t->ncap * 2;
    if (nc < t->window_uses + k)
        nc = t->window_uses + k;
    if (nc < 64)
        nc = 64;
    if (nc > MAX_ENTRIES)
        nc = MAX_ENTRIES;
    Node *nn = PyMem_Realloc(t->nodes, (size_t)nc * sizeof(Node));
    if (nn == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->nodes = nn;
    t->ncap = (int32_t)nc;
    return 0;
}

static inline int32_t
node_alloc(BlockTable *t)
{
    if (t->nfree >= 0) {
        int32_t node = t->nfree;
        t->nfree = t->nodes[node].next;
        return node;
    }
    return t->ntop++;
}

/* room for one more ticket, and queue heads for every entry slot */
static int
window_reserve(BlockTable *t)
{
    if (t->tnext >= MAX_TICKET) {
        PyErr_SetString(PyExc_OverflowError, "a BlockTable hands out fewer than 2**39 hint tickets");
        return -1;
    }
    if (t->qhead == NULL) {
        t->qhead = PyMem_Malloc((size_t)t->cap * sizeof(int32_t));
        if (t->qhead == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(t->qhead, 0xff, (size_t)t->cap * sizeof(int32_t));
    }
    if (t->tnext - t->tbase < t->rcap)
        return 0;
    int64_t nc = t->rcap ? 2 * t->rcap : 16;
    if ((uint64_t)nc > (uint64_t)PY_SSIZE_T_MAX / sizeof(Ticket)) {
        PyErr_NoMemory();
        return -1;
    }
    Ticket *nr = PyMem_Malloc((size_t)nc * sizeof(Ticket));
    if (nr == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t k = t->tbase; k < t->tnext; k++)
        nr[k & (nc - 1)] = t->ring[k & (t->rcap - 1)];
    PyMem_Free(t->ring);
    t->ring = nr;
    t->rcap = nc;
    return 0;
}

/* give the window's memory back once it holds no use (or no ticket) */
static void
window_shrink(BlockTable *t)
{
    if (t->window_uses == 0) {
        PyMem_Free(t->qhead);
        PyMem_Free(t->nodes);
        t->qhead = NULL;
        t->nodes = NULL;
        t->ncap = t->ntop = 0;
        t->nfree = -1;
    }
    if (t->window_requests == 0) {
        PyMem_Free(t->ring);
        t->ring = NULL;
        t->rcap = 0;
        t->tbase = t->tnext;
    }
}

/* the set of hint's first positions of keys without an entry (a power of
   two; calls of up to half as many keys use it) */
#define HINT_FIRSTS 128

static PyObject *
BT_hint(BlockTable *t, PyObject *hashes)
{
    PyObject *seq = as_seq(hashes);
    if (seq == NULL)
        return NULL;
    if (t->in_call) {
        Py_DECREF(seq);
        return reentered();
    }
    t->in_call = 1;
    Items b;
    items_init(&b);
    DupSet dup;
    dup.slots = NULL;
    PyObject *res = NULL;
    if (items_snapshot(&b, seq) < 0)
        goto done;
    Py_ssize_t n = b.n, fresh = 0, newly = 0;
    /* phase 1: find every key; a key without an entry gets a hint-only one,
       made once for all its positions (item.tag: the first of them). Most
       of a request W ahead has none, so the first positions of those are
       kept in a set by hash as the keys are found: a small one on the stack
       (a few instructions a key), a DupSet for a long call */
    int16_t firsts[HINT_FIRSTS];
    int firsts_init = 0;
    if (n > HINT_FIRSTS / 2 && dupset_init(&dup, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &b.v[i];
        if (item_find(t, it) < 0)
            goto done;
        it->tag = (int32_t)i;
        if (it->ix >= 0) {
            /* an entry newly hinted (counted once: its queue is empty) */
            newly += qhead_of(t, it->ix) < 0 && t->entries[it->ix].tag < N_RESIDENT;
            continue;
        }
        int32_t first = (int32_t)i;
        int r = 0;
        if (dup.slots != NULL) {
            r = dupset_add(&dup, b.v, (int32_t)i, &first);
        }
        else {
            if (!firsts_init) {
                memset(firsts, 0xff, sizeof firsts);
                firsts_init = 1;
            }
            size_t k = (size_t)it->hash & (HINT_FIRSTS - 1);
            for (; firsts[k] >= 0; k = (k + 1) & (HINT_FIRSTS - 1)) {
                int32_t j = firsts[k];
                if (b.v[j].hash == it->hash && (r = keys_equal(b.v[j].key, it->key)) != 0) {
                    first = j;
                    break;
                }
            }
            if (r == 0)
                firsts[k] = (int16_t)i;
        }
        if (r < 0)
            goto done;
        it->tag = r > 0 ? first : (int32_t)i;
        fresh += r == 0;
    }
    if (window_reserve(t) < 0 || tbl_reserve(t, fresh) < 0 || nodes_reserve(t, n) < 0 ||
        (t->hold && held_reserve(t, newly) < 0))
        goto done;
    PyObject *ticket = PyLong_FromLongLong(t->tnext);
    if (ticket == NULL)
        goto done;

    /* phase 2 */
    int64_t tk = t->tnext++;
    Ticket *slot = &t->ring[tk & (t->rcap - 1)];
    slot->first = -1;
    slot->n = (int32_t)n;
    t->window_requests++;
    int32_t last = -1;
    Node *N = t->nodes;
    for (Py_ssize_t i = 0; i < n; i++) {
        Item *it = &b.v[i];
        int32_t ix = it->ix;
        if (ix < 0 && it->tag != i) {
            ix = b.v[it->tag].ix; /* made at its first position */
        }
        else if (ix < 0) {
            ix = it->ix = entry_alloc(t);
            Entry *e = &t->entries[ix];
            e->key = Py_NewRef(it->key);
            e->hash = it->hash;
            e->handle = NULL;
            e->ref = 0;
            index_put(t, ix);
            hint_only(t, ix);
        }
        int32_t node = node_alloc(t);
        Node *nd = &N[node];
        nd->key = tk * USE_STRIDE + (i < USE_STRIDE - 1 ? i : USE_STRIDE - 1);
        nd->ix = ix;
        nd->tnext = -1;
        if (last >= 0)
            N[last].tnext = node;
        else
            slot->first = node;
        last = node;
        int32_t head = t->qhead[ix];
        if (head >= 0) { /* a later use: the queue's new tail */
            nd->next = head;
            nd->prev = N[head].prev;
            N[nd->prev].next = node;
            N[head].prev = node;
            continue;
        }
        nd->next = nd->prev = node;
        t->qhead[ix] = node;
        t->window_keys++;
        if (t->entries[ix].tag < N_RESIDENT) {
            t->window_resident++;
            if (t->hold)
                held_add(t, ix);
        }
        else if (t->entries[ix].tag == STALE) { /* hinted again before it went */
            list_unlink(t, ix);
            hint_only(t, ix);
        }
    }
    t->window_uses += n;
    res = ticket;
done:
    if (dup.slots != NULL && dup.slots != dup.small)
        PyMem_Free(dup.slots);
    return leave(t, &b, seq, res);
}

#define SMALL_TICKET 64

/* kvoffload.errors.UnknownTicketError, imported when first needed */
static PyObject *unknown_ticket_type;

/* the manager's error for a ticket not in the window (message as
   kvoffload.table's): the manager hands unhint straight to the table */
static void
raise_unknown_ticket(PyObject *ticket)
{
    if (unknown_ticket_type == NULL) {
        PyObject *mod = PyImport_ImportModule("kvoffload.errors");
        if (mod == NULL)
            return;
        unknown_ticket_type = PyObject_GetAttrString(mod, "UnknownTicketError");
        Py_DECREF(mod);
        if (unknown_ticket_type == NULL)
            return;
    }
    PyObject *msg = PyUnicode_FromFormat(
        "hint ticket %R is not in the window: it was never returned by this manager's hint(), "
        "or was already unhinted",
        ticket);
    if (msg != NULL) {
        PyErr_SetObject(unknown_ticket_type, msg);
        Py_DECREF(msg);
    }
}

/* free the entries on list STALE (trash room reserved) */
static void
stale_flush(BlockTable *t)
{
    List *l = &t->lists[STALE];
    while (l->head >= 0) {
        int32_t ix = l->head;
        list_unlink(t, ix);
        index_del(t, ix);
        trash_push(t, t->entries[ix].key);
        entry_free(t, ix);
    }
}

static PyObject *
BT_unhint(BlockTable *t, PyObject *ticket)
{
    int64_t tk = -1;
    if (PyLong_CheckExact(ticket)) {
        int overflow;
        tk = PyLong_AsLongLongAndOverflow(ticket, &overflow);
        if (overflow)
            tk = -1;
    }
    if (tk < t->tbase || tk >= t->tnext || t->ring[tk & (t->rcap - 1)].n < 0) {
        raise_unknown_ticket(ticket);
        return NULL;
    }
    ENTER(t);
    Ticket *slot = &t->ring[tk & (t->rcap - 1)];
    int32_t n = slot->n;
    int32_t small[SMALL_TICKET], *order = small;
    if (n > SMALL_TICKET && (order = PyMem_Malloc((size_t)n * sizeof(int32_t))) == NULL) {
        PyErr_NoMemory();
        t->in_call = 0;
        return NULL;
    }
    /* the stale entries of the previous unhint go, and this one's too if
       the window empties */
    if (trash_reserve(t, n + t->lists[STALE].size) < 0) {
        if (order != small)
            PyMem_Free(order);
        t->in_call = 0;
        return NULL;
    }
    stale_flush(t);
    /* what the request finds as it leaves: its leading uses whose entries
       are resident and ready */
    Node *N = t->nodes;
    for (int32_t node = slot->first; node >= 0; node = N[node].tnext) {
        const Entry *e = &t->entries[N[node].ix];
        if (e->tag >= N_RESIDENT || e->ref < 0)
            break;
        t->window_found++;
    }
    /* phase 2: every use leaves its queue (prev -2: the last one, which
       emptied it) */
    int32_t k = 0;
    for (int32_t node = slot->first; node >= 0; node = N[node].tnext) {
        order[k++] = node;
        Node *nd = &N[node];
        if (nd->next == node) {
            t->qhead[nd->ix] = -1;
            nd->prev = -2;
            continue;
        }
        N[nd->prev].next = nd->next;
        N[nd->next].prev = nd->prev;
        if (t->qhead[nd->ix] == node)
            t->qhead[nd->ix] = nd->next;
        nd->prev = -1;
    }
    /* last to first: held entries that rejoin their lists end with the first
       hash most recent, as a touch leaves them. Each use is freed on the
       way, so the next hint takes them first to last (its chain then runs
       the way this one did through the pool) */
    for (k = n - 1; k >= 0; k--) {
        Node *nd = &N[order[k]];
        int32_t ix = nd->ix;
        Entry *e = &t->entries[ix];
        if (nd->prev != -2) {
            if (e->place == HELD && e->tag < N_RESIDENT)
                held_restamp(t, ix); /* its next use may have moved on */
        }
        else {
            t->window_keys--;
            if (e->tag < N_RESIDENT) {
                t->window_resident--;
                if (e->place == HELD)
                    held_release(t, ix);
            }
            else if (e->tag == HINT_ONLY) { /* kept until the next unhint: see the top */
                list_append(t, ix, STALE);
            }
        }
        nd->next = t->nfree;
        t->nfree = order[k];
    }
    if (order != small)
        PyMem_Free(order);
    slot->n = -1;
    t->window_requests--;
    t->window_uses -= n;
    if (t->window_requests == 0)
        stale_flush(t);
    while (t->tbase < t->tnext && t->ring[t->tbase & (t->rcap - 1)].n < 0)
        t->tbase++;
    window_shrink(t);
    tbl_shrink(t);
    return leave(t, NULL, NULL, Py_NewRef(Py_None));
}

static PyObject *
next_use_value(BlockTable *t, int32_t ix)
{
    int32_t head = ix < 0 ? -1 : qhead_of(t, ix);
    return PyLong_FromLongLong(head < 0 ? -1 : t->nodes[head].key);
}

static PyObject *
BT_next_uses(BlockTable *t, PyObject *hashes)
{
    return per_hash(t, hashes, next_use_value);
}

static PyObject *
BT_farthest(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "farthest() takes 2 arguments (protected, n), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *prot = args[0];
    if (!PyLong_CheckExact(args[1])) {
        PyErr_Format(PyExc_TypeError, "n must be an int, got %R", args[1]);
        return NULL;
    }
    Py_ssize_t want; /* more than a table holds: every one there is */
    if (count_of(args[1], &want) < 0)
        return NULL;
    ENTER(t);
    PyObject *res = PyList_New(0);
    if (res == NULL) {
        t->in_call = 0;
        return NULL;
    }
    held_order(t);
    Side s;
    side_init_held(t, &s);
    int pmode = protection_mode(prot);
    const Aside *A = &t->held;
    Py_ssize_t found = 0;
    while (s.nfront > 0 && found < want) {
        int32_t pos = front_pop(&s, A->v);
        for (int32_t c = 2 * pos + 1; c <= 2 * pos + 2 && c < A->ready; c++) {
            if (front_push(&s, A->v, c) < 0)
                goto fail;
        }
        int r = is_protected(prot, pmode, t->entries[A->v[pos].ix].key);
        if (r < 0)
            goto fail;
        if (r == 0) {
            PyObject *key = PyLong_FromLongLong(-A->v[pos].stamp);
            if (key == NULL || PyList_Append(res, key) < 0) {
                Py_XDECREF(key);
                goto fail;
            }
            Py_DECREF(key);
            found++;
        }
    }
    side_free(&s);
    t->in_call = 0;
    return res;
fail:
    Py_CLEAR(res);
    side_free(&s);
    t->in_call = 0;
    return NULL;
}

static PyObject *
BT_evicted(BlockTable *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static Sig sig = {"evicted", {"tag", "held"}, 1, 2, 2, {NULL}};
    PyObject *a[2];
    int tg;
    if (parse_args(&sig, args, nargs, kwnames, a) < 0 || resident_tag(a[0], &tg) < 0)
        return NULL;
    int held = a[1] == NULL ? 0 : PyObject_IsTrue(a[1]);
    if (held < 0)
        return NULL;
    if (t->in_call)
        return reentered();
    return PyLong_FromSsize_t(t->evicted[tg][held]);
}

static PyObject *
BT_held(BlockTable *t, PyObject *tag)
{
    int tg;
    if (resident_tag(tag, &tg) < 0)
        return NULL;
    if (t->in_call)
        return reentered();
    return PyLong_FromSsize_t(t->held_n[tg]);
}

static PyObject *
BT_set_hint_order(BlockTable *t, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    ENTER(t);
    PyObject *res = NULL;
    if (on == t->hold) {
        res = Py_NewRef(Py_None);
    }
    else if (on) {
        if (held_reserve(t, t->window_resident) == 0) {
            t->hold = 1;
            /* every hinted resident entry, found through the window's uses */
            for (int64_t tk = t->tbase; tk < t->tnext; tk++) {
                Ticket *slot = &t->ring[tk & (t->rcap - 1)];
                for (int32_t node = slot->n < 0 ? -1 : slot->first; node >= 0;
                     node = t->nodes[node].tnext) {
                    int32_t ix = t->nodes[node].ix;
                    Entry *e = &t->entries[ix];
                    if (e->tag < N_RESIDENT && e->place != HELD)
                        held_add(t, ix);
                }
            }
            res = Py_NewRef(Py_None);
        }
    }
    else {
        Rec *sorted;
        if (unhold_prepare(t, &sorted) == 0) {
            unhold(t, sorted);
            aside_shrink(t);
            res = Py_NewRef(Py_None);
        }
    }
    t->in_call = 0;
    return res;
}

/* ------------------------------------------------------------------------ */
/* _check: the table's internal invariants (for the tests)                  */

#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) {                                          \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);    \
            return -1;                                          \
        }                                                       \
    } while (0)

static int
check_table(BlockTable *t)
{
    Entry *E = t->entries;
    Py_ssize_t seen = 0, resident = 0, pinned = 0, flying = 0;
    CHECK(t->top <= t->cap && t->used <= t->top && t->cap >= MIN_CAP, "bad sizes");
    for (int L = 0; L < N_LISTS; L++) {
        List *l = &t->lists[L];
        Py_ssize_t count = 0;
        int32_t prev = -1;
        for (int32_t ix = l->head; ix >= 0; ix = E[ix].next) {
            CHECK(ix < t->top, "list %d: entry %d beyond top", L, (int)ix);
            Entry *e = &E[ix];
            CHECK(e->key != NULL, "list %d: free slot %d on it", L, (int)ix);
            CHECK(e->prev == prev, "list %d: entry %d has a wrong prev", L, (int)ix);
            CHECK(e->tag == L && e->place == IN_LINE, "list %d: entry %d has tag %d, place %d",
                  L, (int)ix, e->tag, e->place);
            CHECK(L != HINT_ONLY, "hint-only entry %d on a list", (int)ix);
            CHECK(L != STALE || (qhead_of(t, ix) < 0 && t->window_requests > 0),
                  "stale entry %d is hinted, or outlived the window", (int)ix);
            if (L < N_RESIDENT) {
                CHECK(e->handle != NULL, "resident entry %d without a handle", (int)ix);
                CHECK(e->ref >= -1, "entry %d has ref %d", (int)ix, (int)e->ref);
                resident++;
                pinned += e->ref > 0;
                flying += e->ref < 0;
            }
            else {
                CHECK(e->handle == NULL, "ghost %d has a handle", (int)ix);
            }
            prev = ix;
            CHECK(++count <= t->used, "list %d has a cycle", L);
        }
        CHECK(prev == l->tail, "list %d: wrong tail", L);
        CHECK(count == l->size, "list %d: size %zd, %zd entries", L, l->size, count);
        seen += count;
    }
    /* the hint-only entries, on no list */
    for (int32_t ix = 0; ix < t->top; ix++) {
        Entry *e = &E[ix];
        if (e->key == NULL || e->tag != HINT_ONLY)
            continue;
        CHECK(qhead_of(t, ix) >= 0, "hint-only entry %d has no use", (int)ix);
        CHECK(e->handle == NULL && e->place == IN_LINE, "hint-only entry %d has a handle or a place",
              (int)ix);
        seen++;
    }
    /* the records: set aside in each resident tag (tag 0..3), held (4) */
    Py_ssize_t held_n[N_RESIDENT] = {0}, held_ready[N_RESIDENT] = {0};
    for (int tag = 0; tag <= N_RESIDENT; tag++) {
        int is_held = tag == N_RESIDENT;
        Aside *A = is_held ? &t->held : &t->aside[tag];
        CHECK(0 <= A->ready && A->ready <= A->n && A->n <= A->cap, "tag %d: aside sizes", tag);
        CHECK(!is_held || t->hold || A->n == 0, "entries held with hint order off");
        CHECK(is_held ? A->keep >= 0 : A->keep == -1, "tag %d: keep %d", tag, (int)A->keep);
        for (int32_t i = 0; i < A->n; i++) {
            int32_t ix = A->v[i].ix;
            CHECK(ix >= 0 && ix < t->top && E[ix].key != NULL, "tag %d: record %d", tag, (int)i);
            Entry *e = &E[ix];
            CHECK(e->place == (is_held ? HELD : SET_ASIDE) && e->prev == i &&
                      (is_held ? e->tag < N_RESIDENT : e->tag == tag),
                  "records %d: entry %d placed wrongly", tag, (int)ix);
            CHECK(e->handle != NULL, "entry %d set aside without a handle", (int)ix);
            CHECK((i < A->ready) == (e->ref == 0), "tag %d: entry %d ref %d at %d of %d", tag,
                  (int)ix, (int)e->ref, (int)i, (int)A->ready);
            CHECK(i == 0 || i >= A->ready || A->keep == 0 ||
                      A->v[(i - 1) / 2].stamp < A->v[i].stamp,
                  "tag %d: heap order broken at %d", tag, (int)i);
            if (is_held) {
                CHECK(qhead_of(t, ix) >= 0 && A->v[i].stamp == held_stamp(t, ix),
                      "held entry %d: stamp is not its next use", (int)ix);
                held_n[e->tag]++;
                held_ready[e->tag] += e->ref == 0;
            }
            else {
                CHECK(A->v[i].stamp < t->late && A->v[i].stamp > t->early,
                      "tag %d: stamp out of range", tag);
            }
            resident++;
            pinned += e->ref > 0;
            flying += e->ref < 0;
        }
        seen += A->n;
    }
    for (int tag = 0; tag < N_RESIDENT; tag++)
        CHECK(held_n[tag] == t->held_n[tag] && held_ready[tag] == t->held_ready[tag],
              "tag %d: held counts", tag);
    /* the window: every ticket's uses on their entries' queues, in order */
    Py_ssize_t uses = 0, requests = 0, keys = 0, hinted_resident = 0;
    CHECK(t->window_uses == 0 || (t->qhead != NULL && t->nodes != NULL), "window without uses");
    CHECK(t->tbase <= t->tnext && t->tnext - t->tbase <= t->rcap, "ticket ring sizes");
    for (int64_t tk = t->tbase; tk < t->tnext; tk++) {
        Ticket *slot = &t->ring[tk & (t->rcap - 1)];
        CHECK(tk != t->tbase || slot->n >= 0, "the oldest ticket slot is gone");
        if (slot->n < 0)
            continue;
        requests++;
        int32_t k = 0;
        for (int32_t node = slot->first; node >= 0; node = t->nodes[node].tnext, k++) {
            CHECK(node < t->ntop && k < slot->n, "ticket %lld: bad chain", (long long)tk);
            Node *nd = &t->nodes[node];
            int64_t key = tk * USE_STRIDE + (k < USE_STRIDE - 1 ? k : USE_STRIDE - 1);
            CHECK(nd->key == key, "ticket %lld: use %d has key %lld", (long long)tk, (int)k,
                  (long long)nd->key);
            CHECK(nd->ix >= 0 && nd->ix < t->top && E[nd->ix].key != NULL &&
                      qhead_of(t, nd->ix) >= 0,
                  "use %d names no hinted entry", (int)node);
        }
        CHECK(k == slot->n, "ticket %lld: %d uses, %d chained", (long long)tk, (int)slot->n,
              (int)k);
        uses += k;
    }
    CHECK(uses == t->window_uses, "%zd uses in tickets, window_uses %zd", uses, t->window_uses);
    for (int32_t ix = 0; t->qhead != NULL && ix < t->top; ix++) {
        int32_t head = t->qhead[ix];
        if (head < 0)
            continue;
        CHECK(E[ix].key != NULL, "free slot %d has uses", (int)ix);
        keys++;
        hinted_resident += E[ix].tag < N_RESIDENT;
        CHECK(!t->hold || E[ix].tag >= N_RESIDENT || E[ix].place == HELD,
              "hinted resident entry %d not held", (int)ix);
        int32_t node = head, count = 0;
        do {
            Node *nd = &t->nodes[node];
            CHECK(nd->ix == ix && t->nodes[nd->next].prev == node, "entry %d: bad queue", (int)ix);
            CHECK(nd->next == head || nd->key <= t->nodes[nd->next].key,
                  "entry %d: uses out of order", (int)ix);
            CHECK(++count <= uses, "entry %d: queue has a cycle", (int)ix);
            node = nd->next;
        } while (node != head);
        uses -= count;
    }
    CHECK(uses == 0, "%zd uses not on a queue", uses);
    CHECK(requests == t->window_requests && keys == t->window_keys &&
              hinted_resident == t->window_resident,
          "window counts");
    CHECK(seen == t->used, "%zd entries on lists, %d used", seen, (int)t->used);
    CHECK(resident == t->resident, "resident %zd, counted %zd", t->resident, resident);
    CHECK(pinned == t->pinned, "pinned %zd, counted %zd", t->pinned, pinned);
    CHECK(flying == t->in_flight, "in_flight %zd, counted %zd", t->in_flight, flying);
    Py_ssize_t nfree = 0;
    for (int32_t ix = t->free_head; ix >= 0; ix = E[ix].next) {
        CHECK(ix < t->top && E[ix].key == NULL, "bad free slot %d", (int)ix);
        CHECK(++nfree <= t->top, "free list has a cycle");
    }
    CHECK(nfree == t->top - t->used, "%zd free slots, expected %d", nfree,
          (int)(t->top - t->used));
    size_t size = (size_t)1 << t->bits;
    CHECK(t->mask == size - 1, "bad mask");
    CHECK((size_t)t->used * 2 <= size, "index overloaded: %d in %zu", (int)t->used, size);
    Py_ssize_t indexed = 0;
    for (size_t i = 0; i < size; i++) {
        int32_t ix = t->index[i];
        if (ix < 0)
            continue;
        CHECK(ix < t->top && E[ix].key != NULL, "index slot %zu names a free entry", i);
        indexed++;
        /* no hole between its home and where it is */
        for (size_t j = home(E[ix].hash, t->bits); j != i; j = (j + 1) & t->mask)
            CHECK(t->index[j] >= 0, "hole at %zu before entry %d at %zu", j, (int)ix, i);
    }
    CHECK(indexed == t->used, "%zd indexed, %d used", indexed, (int)t->used);
    return 0;
}

static PyObject *
BT_check(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    ENTER(t);
    int r = check_table(t);
    t->in_call = 0;
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* the type                                                                 */

static PyObject *
BT_repr(BlockTable *t)
{
    Py_ssize_t ghosts = 0;
    for (int tag = N_RESIDENT; tag < N_TAGS; tag++)
        ghosts += t->lists[tag].size;
    return PyUnicode_FromFormat("<BlockTable: %zd resident, %zd ghosts>", t->resident, ghosts);
}

#define FAST (METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef BT_methods[] = {
    {"get", (PyCFunction)BT_get, METH_O, "get(h): its handle, or None (absent or ghost)."},
    {"ref", (PyCFunction)BT_ref, METH_O,
     "ref(h): its reference count, or None (absent or ghost)."},
    {"tag_of", (PyCFunction)BT_tag_of, METH_O, "tag_of(h): its tag 0..7, or -1 (no entry)."},
    {"tags", (PyCFunction)BT_tags, METH_O, "tags(hashes) -> list[int]: tag_of of each."},
    {"size", (PyCFunction)BT_size, METH_O, "size(tag): entries of tag (resident or ghosts)."},
    {"lookup", (PyCFunction)BT_lookup, METH_O,
     "lookup(hashes) -> int: how many leading hashes are resident and not in flight."},
    {"absent", (PyCFunction)BT_absent, METH_O,
     "absent(hashes) -> list: the hashes (any iterable) that are not resident, in order."},
    {"items", (PyCFunction)BT_items, METH_O,
     "items(tag) -> list[(hash, handle)]: in order, oldest first; (hash, None) for ghosts."},
    {"keys", (PyCFunction)BT_keys, METH_O, "keys(tag) -> list: the hashes of items(tag)."},
    {"memory_bytes", (PyCFunction)BT_memory_bytes, METH_NOARGS,
     "memory_bytes() -> int: bytes of the entry array and the index."},
    {"__sizeof__", (PyCFunction)BT_sizeof, METH_NOARGS, NULL},
    {"_check", (PyCFunction)BT_check, METH_NOARGS,
     "_check(): raise AssertionError unless the internal invariants hold (tests)."},
    {"insert", (PyCFunction)(void (*)(void))BT_insert, FAST,
     "insert(hashes, handles, tag): new entries in flight, appended to tag's main order."},
    {"insert_chain", (PyCFunction)(void (*)(void))BT_insert_chain, FAST,
     "insert_chain(hashes, handles, tag, readmit) -> list[int] | None: a chain filed\n"
     "tail first, ghosts to readmit, the last hash (no ghost) at tag's oldest end."},
    {"complete", (PyCFunction)BT_complete, METH_O,
     "complete(hashes) -> list: the in-flight ones become ready; returns them."},
    {"fail", (PyCFunction)BT_fail, METH_O,
     "fail(hashes) -> list: the in-flight ones are removed; returns their handles."},
    {"pin", (PyCFunction)BT_pin, METH_O,
     "pin(hashes) -> list: one more reference per occurrence; returns the handles."},
    {"unpin", (PyCFunction)BT_unpin, METH_O,
     "unpin(hashes) -> list: one reference less per occurrence; returns the released."},
    {"remove", (PyCFunction)BT_remove, METH_O,
     "remove(h) -> handle | None: forget a resident entry (no ghost kept)."},
    {"move", (PyCFunction)(void (*)(void))BT_move, FAST,
     "move(h, tag, last=True): to the most recent (or oldest) end of tag's main order."},
    {"relist", (PyCFunction)(void (*)(void))BT_relist, FAST,
     "relist(hashes, tag): each, in order, to the most recent end of tag's main order."},
    {"forget_policy", (PyCFunction)BT_forget_policy, METH_NOARGS,
     "forget_policy(): drop every ghost and restore the default touch rules."},
    {"trim", (PyCFunction)(void (*)(void))BT_trim, FAST,
     "trim(tag, keep) -> int: drop the oldest ghosts of tag until keep remain."},
    {"set_touch_rules", (PyCFunction)BT_set_touch_rules, METH_O,
     "set_touch_rules(rules): what touch does (a kvoffload.table.TouchRules)."},
    {"touch", (PyCFunction)BT_touch, METH_O,
     "touch(hashes) -> list[int] | None: apply the touch rules, last hash first."},
    {"evict", (PyCFunction)(void (*)(void))BT_evict, FAST,
     "evict(a, n, protected, *, b=None, first=None, ghost_a=None, ghost_b=None, spill=False,\n"
     "target=None, trim=None) -> (hashes, handles, n_a) | None: remove n entries from lists\n"
     "a and b."},
    {"evicted", (PyCFunction)(void (*)(void))BT_evicted, FAST,
     "evicted(tag, held=False) -> int: victims evictions took from tag's order (held: of\n"
     "tag's held entries)."},
    {"hint", (PyCFunction)BT_hint, METH_O,
     "hint(hashes) -> int: a hinted request joins the window; returns its ticket."},
    {"unhint", (PyCFunction)BT_unhint, METH_O,
     "unhint(ticket): the hinted request leaves the window."},
    {"next_uses", (PyCFunction)BT_next_uses, METH_O,
     "next_uses(hashes) -> list[int]: the key of each one's next hinted use, -1 if none."},
    {"farthest", (PyCFunction)(void (*)(void))BT_farthest, METH_FASTCALL,
     "farthest(protected, n) -> list[int]: the next uses of the n ready held entries not\n"
     "in protected that go first (farthest first; fewer if there are fewer)."},
    {"held", (PyCFunction)BT_held, METH_O, "held(tag) -> int: the held entries of tag."},
    {"set_hint_order", (PyCFunction)BT_set_hint_order, METH_O,
     "set_hint_order(on): hold hinted resident entries out of their lists' orders."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef BT_members[] = {
    {"pinned", T_PYSSIZET, offsetof(BlockTable, pinned), READONLY,
     "resident entries with ref > 0"},
    {"in_flight", T_PYSSIZET, offsetof(BlockTable, in_flight), READONLY,
     "resident entries with ref == -1"},
    {"walked", T_PYSSIZET, offsetof(BlockTable, walked), READONLY,
     "entries evictions walked past (a statistic)"},
    {"window_requests", T_PYSSIZET, offsetof(BlockTable, window_requests), READONLY,
     "tickets in the hint window"},
    {"window_uses", T_PYSSIZET, offsetof(BlockTable, window_uses), READONLY,
     "hashes hinted by the tickets in the window (repeats counted)"},
    {"window_keys", T_PYSSIZET, offsetof(BlockTable, window_keys), READONLY,
     "distinct hashes with a use in the window"},
    {"window_resident", T_PYSSIZET, offsetof(BlockTable, window_resident), READONLY,
     "resident entries with a use in the window"},
    {"holds", T_PYSSIZET, offsetof(BlockTable, holds), READONLY,
     "times an entry was held for a hinted use (a statistic)"},
    {"window_found", T_PYSSIZET, offsetof(BlockTable, window_found), READONLY,
     "leading hashes of the requests unhinted that were resident and ready then"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *
BT_get_held_ready(BlockTable *t, void *closure)
{
    (void)closure;
    Py_ssize_t n = 0;
    for (int tag = 0; tag < N_RESIDENT; tag++)
        n += t->held_ready[tag];
    return PyLong_FromSsize_t(n);
}

static PyGetSetDef BT_getset[] = {
    {"held_ready", (getter)BT_get_held_ready, NULL,
     "held entries that are ready (not pinned, not in flight)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods BT_as_sequence = {
    .sq_length = (lenfunc)BT_len,
    .sq_contains = (objobjproc)BT_contains,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._table.BlockTable",
    .tp_basicsize = sizeof(BlockTable),
    .tp_itemsize = 0,
    .tp_dealloc = (destructor)BT_dealloc,
    .tp_repr = (reprfunc)BT_repr,
    .tp_as_sequence = &BT_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockTable(): the block table in C (see docs/block-table.md).",
    .tp_methods = BT_methods,
    .tp_members = BT_members,
    .tp_getset = BT_getset,
    .tp_new = BT_new,
};

static struct PyModuleDef table_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload._table",
    .m_doc = "The block table in C (see docs/block-table.md).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__table(void)
{
    if (PyType_Ready(&BlockTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&table_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
