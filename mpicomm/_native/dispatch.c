/* Dispatcher.call's common case (mpicomm/_dispatch.py), compiled: see _callpath.c. */
#include "callpath.h"

/* ------------------------------------------------------------------ state */

/* the Dispatcher's slots this path reads, by offset in the instance */
enum { S_LAST, S_MEM, S_ROW, S_SEQ, S_SHR, S_SHB, S_FR, S_FMASK, S_P1, S_P1B, S_P1J, S_MORE,
       S_GROUP, S_WATCH, S_CB, S_N };
static const char *slot_names[S_N] = {"last", "mem", "row", "seq", "shr", "shb", "fr", "fmask",
                                      "p1", "p1b", "p1j", "more", "group", "watch", "cb"};
static Py_ssize_t off[S_N];
#define SLOT(self, i) (*(PyObject **)((char *)(self) + off[i]))

static PyTypeObject *disp_type = NULL;
static PyTypeObject *prep_type = NULL;      /* mpicomm._backends.base.Prepared */
static Py_ssize_t off_key, off_sig, off_run; /* its slots */
#define PSLOT(p, o) (*(PyObject **)((char *)(p) + (o)))
static PyObject *dropped = NULL;            /* mpicomm._backends.base._dropped (a list) */
static PyObject *complete_dropped = NULL;   /* mpicomm._backends.base.complete_dropped */
/* The words' layout, given by install() from the Python modules that define it
 * (mpicomm._dispatch.NATIVE_LAYOUT: mpicomm/_reliability/progress.py and agreement.py) */
static Py_ssize_t at_done = 0, at_poison = 0, at_hist = 0, at_ckpt = 0, ck_end = 0;
static long long calls_n = 0, calls_mask = 0;   /* the row's ring of calls (CALLS_N) */
static long long host_n = 0, host_mask = 0;     /* the host-shared copy of it (HOST_N) */
static uint64_t hist_mul = 0, hist_mask = 0;    /* the history's hash step (HMUL, HMASK) */
static int ck_levels = 0, ck_n = 0, ck_shift = 0, ck_step = 0;   /* its checkpoints (CK_*) */
static int configured = 0;

static PyObject *s_shape, *s_dtype, *s_call_new, *s_run_new, *s_py_call, *s_poisoned, *s_poisoned_after,
    *s_differs, *s_raise_in_call, *s__group, *s__seq, *s__watch, *s___class__;

int dispatch_init(PyObject *m)
{
    INTERN(s_shape, "shape"); INTERN(s_dtype, "dtype"); INTERN(s_call_new, "call_new"); INTERN(s_run_new, "run_new");
    INTERN(s_py_call, "py_call"); INTERN(s_poisoned, "poisoned"); INTERN(s_poisoned_after, "poisoned_after");
    INTERN(s_differs, "differs"); INTERN(s_raise_in_call, "raise_in_call"); INTERN(s__group, "_group");
    INTERN(s__seq, "_seq"); INTERN(s__watch, "_watch"); INTERN(s___class__, "__class__");
    return 0;
}

static PyObject *method(PyObject *self, PyObject *name, PyObject *const *args, size_t n)
{
    PyObject *a[9];   /* (n <= 8) */
    a[0] = self;
    for (size_t i = 0; i < n; i++)
        a[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, a, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* self.<name>(seq, code, ...) with seq made an int; returns a new reference or NULL */
static PyObject *method_seq(PyObject *self, PyObject *name, long long seq, PyObject *code, PyObject *a2,
                            PyObject *a3)
{
    PyObject *s = PyLong_FromLongLong(seq);
    if (s == NULL)
        return NULL;
    PyObject *args[4] = {s, code, a2, a3};
    PyObject *r = method(self, name, args, a2 == NULL ? 2 : (a3 == NULL ? 3 : 4));
    Py_DECREF(s);
    return r;
}

/* ------------------------------------------------------------------ Dispatcher.call */

/* A call's signature compared with a prepared call's key, without building the key: this
 * mirrors mpicomm._dispatch.call_key, the key's one definition (its KEY_LEN items, in its
 * order: x.__class__, x.shape, x.dtype, arg, stream, async_op, out is None, out is x), compared
 * as Python compares two tuples, item by item, so that both paths agree on every call.
 * tests/test_callpath_parity.py checks, through key_matches_py, that both decide alike.
 * 1: the key matches, 0: it does not (or x has no shape/dtype), -1: an error */
#define KEY_LEN 8
static int key_matches(PyObject *k, PyObject *x, PyObject *out, PyObject *arg, PyObject *async_op,
                       PyObject *stream)
{
    if (k == NULL || !PyTuple_CheckExact(k) || PyTuple_GET_SIZE(k) != KEY_LEN)
        return 0;
    if (PyTuple_GET_ITEM(k, 0) != (PyObject *)Py_TYPE(x)) {
        PyObject *cls = PyObject_GetAttr(x, s___class__);
        if (cls == NULL)
            return -1;
        int r = PyObject_RichCompareBool(cls, PyTuple_GET_ITEM(k, 0), Py_EQ);
        Py_DECREF(cls);
        if (r != 1)
            return r;
    }
    /* the Python path builds the whole key first: an AttributeError there means "no key" */
    PyObject *shape = PyObject_GetAttr(x, s_shape);
    if (shape == NULL)
        goto attr;
    PyObject *dtype = PyObject_GetAttr(x, s_dtype);
    if (dtype == NULL) {
        Py_DECREF(shape);
        goto attr;
    }
    int r = PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(k, 1), Py_EQ);
    if (r == 1)
        r = PyObject_RichCompareBool(dtype, PyTuple_GET_ITEM(k, 2), Py_EQ);
    Py_DECREF(shape);
    Py_DECREF(dtype);
    if (r != 1)
        return r;
    if ((r = PyObject_RichCompareBool(arg, PyTuple_GET_ITEM(k, 3), Py_EQ)) != 1)
        return r;
    if ((r = PyObject_RichCompareBool(stream, PyTuple_GET_ITEM(k, 4), Py_EQ)) != 1)
        return r;
    if ((r = PyObject_RichCompareBool(async_op, PyTuple_GET_ITEM(k, 5), Py_EQ)) != 1)
        return r;
    if ((r = PyObject_RichCompareBool(out == Py_None ? Py_True : Py_False, PyTuple_GET_ITEM(k, 6), Py_EQ)) != 1)
        return r;
    return PyObject_RichCompareBool(out == x ? Py_True : Py_False, PyTuple_GET_ITEM(k, 7), Py_EQ);
attr:
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* key_matches(key, x, out, arg, async_op, stream) -> bool: the compiled path's decision
 * whether a call of these arguments reuses the prepared call of ``key`` (for the tests) */
PyObject *key_matches_py(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "key_matches() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    int r = key_matches(args[0], args[1], args[2], args[3], args[4], args[5]);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* the call raised: raise_in_call(seq, code, e) publishes it and raises (with e handled, as
 * in the Python path's except clause) */
static PyObject *raised(PyObject *self, long long seq, PyObject *code)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL)
        PyException_SetTraceback(v, tb);
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *outer = PyErr_GetHandledException();
    PyErr_SetHandledException(v);
    PyObject *r = method_seq(self, s_raise_in_call, seq, code, v, NULL);
    PyErr_SetHandledException(outer);
    Py_XDECREF(outer);
#else
    PyObject *r = method_seq(self, s_raise_in_call, seq, code, v, NULL);
#endif
    if (r != NULL) {   /* (it always raises; should it not, the call's own error stands) */
        Py_DECREF(r);
        PyErr_Restore(t, v, tb);
        return NULL;
    }
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return NULL;
}

static PyObject *py_call(PyObject *self, PyObject *const *args)
{
    return method(self, s_py_call, args, 6);
}

/* The call's words before it runs: its number (the seq slot, returned as *seqo, borrowed), a
 * report word looked at, ENTERED, the ring of calls, the host's ring, the flight recorder's
 * entry (Dispatcher.call; its publish()). 0, or -1 with an error (after the number was taken,
 * as in the Python path), or 1 where taking in the report made the group's fresh communicator:
 * ``p`` is the old one's, and the call goes to run_new (numbered, nothing else published). */
typedef struct {
    int64_t *m;
    long long b, cb, seq;
    int64_t v, w;
    int64_t *sh;    /* the host-shared ring segment, or NULL */
} Call;

/* the group's history of calls (progress.py: HIST, CKPT, checkpoint()): a running hash of the
 * ring words, and at the calls that are multiples of 1 << CK_SHIFT its checkpoints */
static void history(int64_t *row, long long seq, int64_t w)
{
    int64_t h = (int64_t)(((uint64_t)load(row + at_hist) * hist_mul ^ (uint64_t)w) & hist_mask);
    store(row + at_hist, h);
    for (int lv = 0; lv < ck_levels; lv++) {
        int s = ck_shift + ck_step * lv;
        if (seq & ((1LL << s) - 1))
            return;
        int64_t *e = row + at_ckpt + 2 * (lv * ck_n + ((seq >> s) & (ck_n - 1)));
        store(e, 0);
        store(e + 1, h);
        store(e, (int64_t)seq);
    }
}

static int enter(PyObject *self, Call *c, PyObject *p, PyObject *const *args, long long sig, PyObject **seqo)
{
    PyObject *code = args[0], *t;
    Py_ssize_t nm;
    c->seq += 1;
    if (!(*seqo = PyLong_FromLongLong(c->seq)))
        return -1;
    Py_SETREF(SLOT(self, S_SEQ), *seqo);   /* (borrowed from here on: the slot holds it) */
    c->v = (int64_t)(c->seq << 4 | PyLong_AsLong(code));
    if (load(c->m + c->b + at_poison)) {    /* a peer's report, or this rank's own resync due */
        PyObject *call = PyTuple_Pack(5, args[1], args[2], args[3], args[4], args[5]);
        if (call == NULL)
            return -1;
        t = method_seq(self, s_poisoned, c->seq, code, call, NULL);
        Py_DECREF(call);
        if (t == NULL)
            return -1;
        Py_DECREF(t);
        PyObject *last = SLOT(self, S_LAST);
        Py_ssize_t k = PyLong_AsSsize_t(code);
        if (last == NULL || !PyList_CheckExact(last) || k < 0 || k >= PyList_GET_SIZE(last)
            || PyList_GET_ITEM(last, k) != p)
            return 1;
        if (!(c->m = words(SLOT(self, S_MEM), &nm)) || c->b + at_poison >= nm || c->b + ck_end >= nm
            || c->cb + calls_n > nm) {
            PyErr_SetString(PyExc_ValueError, "mpicomm: the group's progress words are gone");
            return -1;
        }
    }
    store(c->m + c->b, c->v);
    c->w = (int64_t)(c->seq << 32 | sig);
    store(c->m + c->cb + (c->seq & calls_mask), c->w);   /* the ring of calls (mpicomm._reliability.progress) */
    history(c->m + c->b, c->seq, c->w);
    long long shb = 0, fmask;
    Py_ssize_t nsh = 0;
    PyObject *sho = SLOT(self, S_SHR);
    c->sh = NULL;
    if (sho != NULL && sho != Py_None) {
        if (!(c->sh = words(sho, &nsh)) || as_ll(SLOT(self, S_SHB), &shb) || shb < 0 || shb + host_n > nsh) {
            PyErr_SetString(PyExc_ValueError, "mpicomm: the host's ring of calls is not an int64 memoryview");
            return -1;
        }
        c->sh += shb;
        store(c->sh + (c->seq & host_mask), c->w);
    }
    PyObject *fr = SLOT(self, S_FR);
    if (fr == NULL || fr == Py_None)
        return 0;
    if (!PyList_CheckExact(fr) || as_ll(SLOT(self, S_FMASK), &fmask) || (c->seq & fmask) >= PyList_GET_SIZE(fr)) {
        PyErr_SetString(PyExc_ValueError, "mpicomm: the flight recorder's ring is not a list");
        return -1;
    }
    PyObject *n = PyLong_FromLongLong(now_ns());
    if (n == NULL)
        return -1;
    PyObject *e = PyList_GET_ITEM(fr, c->seq & fmask);
    if (e != NULL && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 4 && Py_REFCNT(e) == 1) {
        /* the entry it replaces is referenced by the ring alone: refilled in place */
        PyObject *items[4] = {*seqo, code, p, n};
        for (int i = 0; i < 4; i++)
            Py_SETREF(PyTuple_GET_ITEM(e, i), Py_NewRef(items[i]));
        Py_DECREF(n);
        return 0;
    }
    e = PyTuple_Pack(4, *seqo, code, p, n);
    Py_DECREF(n);
    if (e == NULL)
        return -1;
    return PyList_SetItem(fr, c->seq & fmask, e);   /* (steals e) */
}

/* After the call (mpicomm._dispatch.Dispatcher.finish_call, step for step; an async call's
 * Work is described and DONE stored before it, in disp_call): a report that arrived during
 * it, the host neighbours' words for this number compared, DONE. 0, or -1 with an error. */
static int leave(PyObject *self, Call *c, PyObject *code)
{
    PyObject *t;
    if (load(c->m + c->b + at_poison)) {   /* a peer's report arrived during the call */
        if (!(t = method_seq(self, s_poisoned_after, c->seq, code, NULL, NULL)))
            return -1;
        Py_DECREF(t);
    }
    if (c->sh != NULL) {   /* the host neighbours' calls of this sequence number */
        long long kk = c->seq & host_mask;
        PyObject *more = SLOT(self, S_MORE);
        PyObject *trip[3] = {SLOT(self, S_P1), SLOT(self, S_P1B), SLOT(self, S_P1J)};
        Py_ssize_t nmore = (more != NULL && PyTuple_CheckExact(more)) ? PyTuple_GET_SIZE(more) : 0;
        for (Py_ssize_t i = -1; i < nmore; i++) {
            if (i >= 0) {
                PyObject *it = PyTuple_GET_ITEM(more, i);
                if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 3)
                    continue;
                for (int j = 0; j < 3; j++)
                    trip[j] = PyTuple_GET_ITEM(it, j);
            }
            Py_ssize_t np;
            long long pb;
            int64_t *pm = words(trip[0], &np);
            if (pm == NULL || as_ll(trip[1], &pb) || pb < 0 || pb + host_n > np || trip[2] == NULL) {
                PyErr_SetString(PyExc_ValueError, "mpicomm: a host neighbour's ring of calls is not an int64 memoryview");
                return -1;
            }
            int64_t pw = load(pm + pb + kk);
            if (pw != c->w && (pw >> 32) == c->seq) {
                PyObject *pwo = PyLong_FromLongLong(pw);
                if (pwo == NULL)
                    return -1;
                t = method_seq(self, s_differs, c->seq, code, trip[2], pwo);
                Py_DECREF(pwo);
                if (t == NULL)
                    return -1;
                Py_DECREF(t);
            }
        }
    }
    store(c->m + c->b + at_done, c->v);
    return 0;
}

/* An async call's Work: its group, number and watchdog, as the Python path sets them. */
static int describe_work(PyObject *self, PyObject *r, PyObject *seqo)
{
    PyObject *g = SLOT(self, S_GROUP), *wd = SLOT(self, S_WATCH);
    return PyObject_SetAttr(r, s__group, g ? g : Py_None) || PyObject_SetAttr(r, s__seq, seqo)
           || PyObject_SetAttr(r, s__watch, wd ? wd : Py_None) ? -1 : 0;
}

/* Dispatcher.call(code, x, out, arg, async_op, stream) */
static PyObject *disp_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "call() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    Call c;
    long long code;
    Py_ssize_t nm = 0;
    PyObject *last = configured && PyObject_TypeCheck(self, disp_type) ? SLOT(self, S_LAST) : NULL;
    c.m = words(last ? SLOT(self, S_MEM) : NULL, &nm);
    if (last == NULL || !PyList_CheckExact(last) || as_ll(args[0], &code) || code < 0 || code >= PyList_GET_SIZE(last)
        || c.m == NULL || as_ll(SLOT(self, S_ROW), &c.b) || as_ll(SLOT(self, S_CB), &c.cb)
        || as_ll(SLOT(self, S_SEQ), &c.seq) || c.b < 0 || c.b + at_done >= nm || c.b + at_poison >= nm
        || c.b + ck_end >= nm || c.cb < 0
        || c.cb + calls_n > nm)
        return py_call(self, args);
    PyObject *p = PyList_GET_ITEM(last, code);
    if (Py_TYPE(p) != prep_type)   /* the empty entry (NEVER): a new call */
        return method(self, s_call_new, args, 6);
    Py_INCREF(p);
    PyObject *k = Py_XNewRef(PSLOT(p, off_key));
    int match = key_matches(k, args[1], args[2], args[3], args[4], args[5]);
    Py_XDECREF(k);
    long long sig;
    PyObject *run = PSLOT(p, off_run);
    if (match != 1 || run == NULL || as_ll(PSLOT(p, off_sig), &sig)) {
        Py_DECREF(p);
        if (match < 0)
            return NULL;
        return match == 1 ? py_call(self, args) : method(self, s_call_new, args, 6);
    }
    Py_INCREF(run);
    PyObject *r = NULL, *t, *seqo;
    if (PyList_GET_SIZE(dropped)) {   /* Works dropped unwaited complete first */
        if (!(t = PyObject_CallNoArgs(complete_dropped)))
            goto done;
        Py_DECREF(t);
    }
    int e = enter(self, &c, p, args, sig, &seqo);
    if (e < 0)
        goto done;
    if (e > 0) {   /* run_new(seq, code, None, x, out, arg, async_op, stream) */
        PyObject *a[8] = {seqo, args[0], Py_None, args[1], args[2], args[3], args[4], args[5]};
        r = method(self, s_run_new, a, 8);
        goto done;
    }
    r = PyObject_Vectorcall(run, args + 1, 2, NULL);   /* run(x, out) */
    if (r == NULL) {   /* the call is over on this rank: published as raised */
        raised(self, c.seq, args[0]);
        goto done;
    }
    /* (an async call's Work described first: one whose call raises in leave() is left, not
     * waited for, once dropped) */
    int a = PyObject_IsTrue(args[4]);
    if (a > 0)   /* (started: over here; a member that refuses it does not stand in for this rank) */
        store(c.m + c.b + at_done, c.v);
    if (a < 0 || (a && describe_work(self, r, seqo) < 0) || leave(self, &c, args[0]) < 0)
        Py_CLEAR(r);
done:
    Py_DECREF(run);
    Py_DECREF(p);
    return r;
}

static PyMethodDef call_def = {"call", (PyCFunction)(void (*)(void))disp_call, METH_FASTCALL,
    "call(code, x, out, arg, async_op, stream)\n--\n\n"
    "Run collective ``code`` on ``x`` (mpicomm._dispatch.Dispatcher.call, compiled: the common "
    "case; anything else goes to the Python path)."};

/* the offset of slot ``name`` of class ``cls`` (an object slot), or -1 with an error */
static Py_ssize_t slot_offset(PyObject *cls, const char *name)
{
    PyObject *d = PyObject_GetAttrString(cls, name);
    if (d == NULL)
        return -1;
    Py_ssize_t o = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX)
        o = ((PyMemberDescrObject *)d)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "%R.%s is not a slot", cls, name);
    Py_DECREF(d);
    return o;
}

/* layout[name] as a C integer in [lo, hi] (a power of two where pow2), or -1 with an error */
static long long layout_int(PyObject *layout, const char *name, long long lo, long long hi, int pow2)
{
    PyObject *v = PyDict_GetItemString(layout, name);   /* (borrowed) */
    long long r;
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "install(): the layout has no %s", name);
        return -1;
    }
    if (as_ll(v, &r) || r < lo || r > hi || (pow2 && (r & (r - 1)))) {
        PyErr_Format(PyExc_ValueError, "install(): %s=%R is not %s in [%lld, %lld]", name, v,
                     pow2 ? "a power of two" : "an integer", lo, hi);
        return -1;
    }
    return r;
}

/* install(Dispatcher, Prepared, dropped, complete_dropped, layout) -> the method descriptor.
 * layout: {name: int} of the words' layout (mpicomm._dispatch.NATIVE_LAYOUT) */
PyObject *install(PyObject *mod, PyObject *args)
{
    PyObject *cls, *pcls, *dl, *cd, *lay;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!", &PyType_Type, &cls, &PyType_Type, &pcls, &PyList_Type, &dl, &cd,
                          &PyDict_Type, &lay))
        return NULL;
    long long ad, ap, ah, ac, cn, hn, hmul, hmask, ckl, ckn, cks, ckt;
    if ((ad = layout_int(lay, "AT_DONE", 1, 1 << 16, 0)) < 0 || (ap = layout_int(lay, "AT_POISON", 1, 1 << 16, 0)) < 0
        || (ah = layout_int(lay, "AT_HIST", 1, 1 << 16, 0)) < 0 || (ac = layout_int(lay, "AT_CKPT", 1, 1 << 16, 0)) < 0
        || (cn = layout_int(lay, "CALLS_N", 1, 1 << 20, 1)) < 0 || (hn = layout_int(lay, "HOST_N", 1, 1 << 20, 1)) < 0
        || (hmul = layout_int(lay, "HMUL", 1, 0xFFFFFFFFLL, 0)) < 0
        || (hmask = layout_int(lay, "HMASK", 1, 0xFFFFFFFFLL, 0)) < 0
        || (ckl = layout_int(lay, "CK_LEVELS", 0, 8, 0)) < 0 || (ckn = layout_int(lay, "CK_N", 1, 1 << 10, 1)) < 0
        || (cks = layout_int(lay, "CK_SHIFT", 1, 30, 0)) < 0 || (ckt = layout_int(lay, "CK_STEP", 0, 30, 0)) < 0)
        return NULL;
    if (cks + ckt * (ckl > 0 ? ckl - 1 : 0) > 62) {
        PyErr_SetString(PyExc_ValueError, "install(): CK_SHIFT + CK_STEP * (CK_LEVELS - 1) is over 62");
        return NULL;
    }
    if ((off_key = slot_offset(pcls, "key")) < 0 || (off_sig = slot_offset(pcls, "sig")) < 0
        || (off_run = slot_offset(pcls, "run")) < 0)
        return NULL;
    for (int i = 0; i < S_N; i++)
        if ((off[i] = slot_offset(cls, slot_names[i])) < 0)
            return NULL;
    Py_XSETREF(disp_type, (PyTypeObject *)Py_NewRef(cls));
    Py_XSETREF(prep_type, (PyTypeObject *)Py_NewRef(pcls));
    Py_XSETREF(dropped, Py_NewRef(dl));
    Py_XSETREF(complete_dropped, Py_NewRef(cd));
    at_done = (Py_ssize_t)ad;
    at_poison = (Py_ssize_t)ap;
    at_hist = (Py_ssize_t)ah;
    at_ckpt = (Py_ssize_t)ac;
    calls_n = cn;
    calls_mask = cn - 1;
    host_n = hn;
    host_mask = hn - 1;
    hist_mul = (uint64_t)hmul;
    hist_mask = (uint64_t)hmask;
    ck_levels = (int)ckl;
    ck_n = (int)ckn;
    ck_shift = (int)cks;
    ck_step = (int)ckt;
    ck_end = at_ckpt + 2 * ck_levels * ck_n - 1;
    configured = 1;
    return PyDescr_NewMethod((PyTypeObject *)cls, &call_def);
}
