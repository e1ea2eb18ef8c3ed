/* mpicomm's call path in C: Dispatcher.call's common case, and the NCCL run of a
 * blocking collective on CuPy arrays or PyTorch tensors.
 *
 * Both are the Python code they replace, step for step (mpicomm/_dispatch.py
 * Dispatcher.call; mpicomm/_backends/nccl.py NCCLTransport._run), written out in C
 * because at 8 bytes a collective's time over the library's is its Python. Anything
 * but the common case goes back to the Python it mirrors before any side effect: a
 * new signature (call_new), a report word set (poisoned), an error in the call
 * (raise_in_call), an array the NCCL run does not take as it comes (run_any).
 *
 * The dispatcher's state stays in the Python object: this module reads its __slots__
 * at their offsets (found once, from the class's member descriptors), so Python and C
 * see one sequence number and one set of progress words. MPICOMM_NATIVE=0 leaves the
 * Python path in place (mpicomm/_native/__init__.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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
static Py_ssize_t at_done = 0, at_poison = 0;
static int configured = 0;

static PyObject *s__c_contiguous, *s_data, *s_device_id, *s_ptr, *s_shape, *s_dtype, *s_call_new, *s_py_call, *s_poisoned,
    *s_poisoned_after, *s_differs, *s_raise_in_call, *s__group, *s__seq, *s__watch, *s_last_stream,
    *s_last_what, *s_comm, *s___class__;

static int intern_all(void)
{
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return -1
    I(s_shape, "shape"); I(s_dtype, "dtype");
    I(s_call_new, "call_new"); I(s_py_call, "py_call"); I(s_poisoned, "poisoned");
    I(s_poisoned_after, "poisoned_after"); I(s_differs, "differs"); I(s_raise_in_call, "raise_in_call");
    I(s__group, "_group"); I(s__seq, "_seq"); I(s__watch, "_watch"); I(s_last_stream, "last_stream");
    I(s_last_what, "last_what"); I(s_comm, "comm"); I(s___class__, "__class__");
    I(s__c_contiguous, "_c_contiguous"); I(s_data, "data"); I(s_device_id, "device_id"); I(s_ptr, "ptr");
#undef I
    return 0;
}

/* An int64 memoryview's words, or NULL (not one, or released: the Python path says why). */
static inline int64_t *words(PyObject *m, Py_ssize_t *n)
{
    if (m == NULL || !PyMemoryView_Check(m))
        return NULL;
    if (((PyMemoryViewObject *)m)->flags & _Py_MEMORYVIEW_RELEASED)
        return NULL;
    Py_buffer *v = PyMemoryView_GET_BUFFER(m);
    if (v->itemsize != 8 || v->buf == NULL)
        return NULL;
    *n = v->len / 8;
    return (int64_t *)v->buf;
}

static inline int as_ll(PyObject *o, long long *r)
{
    if (o == NULL || !PyLong_CheckExact(o))
        return -1;
    int overflow;
    *r = PyLong_AsLongLongAndOverflow(o, &overflow);
    return overflow ? -1 : 0;
}

static inline void store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* time.perf_counter_ns's clock on Linux */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* self.<name>(args...) */
static PyObject *method(PyObject *self, PyObject *name, PyObject *const *args, size_t n)
{
    PyObject *a[8];
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

/* 1: the key matches, 0: it does not (or x has no shape/dtype), -1: an error */
static int key_matches(PyObject *k, PyObject *x, PyObject *out, PyObject *arg, PyObject *async_op,
                       PyObject *stream)
{
    if (k == NULL || !PyTuple_CheckExact(k) || PyTuple_GET_SIZE(k) != 8)
        return 0;
    /* compared as the Python path's tuple compares (x.__class__, x.shape, ...) with the key,
     * item by item, so that both paths agree on every call */
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

/* Dispatcher.call(code, x, out, arg, async_op, stream) */
static PyObject *disp_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !configured || !PyObject_TypeCheck(self, disp_type)) {
        if (nargs != 6) {
            PyErr_Format(PyExc_TypeError, "call() takes 6 arguments (%zd given)", nargs);
            return NULL;
        }
        return py_call(self, args);
    }
    PyObject *code = args[0], *x = args[1], *out = args[2], *arg = args[3], *async_op = args[4],
             *stream = args[5];
    PyObject *last = SLOT(self, S_LAST);
    long long c, b, cb, seq;
    Py_ssize_t nm;
    int64_t *m = words(SLOT(self, S_MEM), &nm);
    if (last == NULL || !PyList_CheckExact(last) || as_ll(code, &c) || c < 0 || c >= PyList_GET_SIZE(last)
        || m == NULL || as_ll(SLOT(self, S_ROW), &b) || as_ll(SLOT(self, S_CB), &cb)
        || as_ll(SLOT(self, S_SEQ), &seq) || b < 0 || b + at_done >= nm || b + at_poison >= nm || cb < 0
        || cb + 256 > nm)
        return py_call(self, args);
    PyObject *p = PyList_GET_ITEM(last, c);
    if (Py_TYPE(p) != prep_type)   /* the empty entry (NEVER): a new call */
        return method(self, s_call_new, args, 6);
    Py_INCREF(p);
    PyObject *k = PSLOT(p, off_key);
    Py_XINCREF(k);
    int match = key_matches(k, x, out, arg, async_op, stream);
    Py_XDECREF(k);
    if (match != 1) {
        Py_DECREF(p);
        if (match < 0)
            return NULL;
        return method(self, s_call_new, args, 6);
    }
    long long sig;
    PyObject *run = PSLOT(p, off_run);
    if (run == NULL || as_ll(PSLOT(p, off_sig), &sig)) {
        Py_DECREF(p);
        return py_call(self, args);
    }
    Py_INCREF(run);
    PyObject *r = NULL, *t;
    if (PyList_GET_SIZE(dropped)) {   /* Works dropped unwaited complete first */
        if (!(t = PyObject_CallNoArgs(complete_dropped)))
            goto done;
        Py_DECREF(t);
    }
    seq += 1;
    PyObject *seqo = PyLong_FromLongLong(seq);
    if (seqo == NULL)
        goto done;
    Py_SETREF(SLOT(self, S_SEQ), seqo);   /* (borrowed below: the slot holds it) */
    int64_t v = (int64_t)(seq << 4 | c);
    if (load(m + b + at_poison)) {    /* a peer's report, or this rank's own resync due */
        PyObject *call = PyTuple_Pack(5, x, out, arg, async_op, stream);
        if (call == NULL)
            goto done;
        t = method_seq(self, s_poisoned, seq, code, call, NULL);
        Py_DECREF(call);
        if (t == NULL)
            goto done;
        Py_DECREF(t);
        if (!(m = words(SLOT(self, S_MEM), &nm)) || b + at_poison >= nm || cb + 256 > nm) {
            PyErr_SetString(PyExc_ValueError, "mpicomm: the group's progress words are gone");
            goto done;
        }
    }
    store(m + b, v);
    int64_t w = (int64_t)(seq << 32 | sig);
    store(m + cb + (seq & 255), w);   /* the ring of calls (mpicomm._reliability.progress) */
    long long shb = 0, fmask;
    Py_ssize_t nsh = 0;
    PyObject *sho = SLOT(self, S_SHR);
    int64_t *sh = NULL;
    if (sho != NULL && sho != Py_None) {
        if (!(sh = words(sho, &nsh)) || as_ll(SLOT(self, S_SHB), &shb) || shb < 0 || shb + 8 > nsh) {
            PyErr_SetString(PyExc_ValueError, "mpicomm: the host's ring of calls is not an int64 memoryview");
            goto done;
        }
        store(sh + shb + (seq & 7), w);
    }
    PyObject *fr = SLOT(self, S_FR);
    if (fr != NULL && fr != Py_None) {
        if (!PyList_CheckExact(fr) || as_ll(SLOT(self, S_FMASK), &fmask)
            || (seq & fmask) >= PyList_GET_SIZE(fr)) {
            PyErr_SetString(PyExc_ValueError, "mpicomm: the flight recorder's ring is not a list");
            goto done;
        }
        PyObject *n = PyLong_FromLongLong(now_ns());
        if (n == NULL)
            goto done;
        PyObject *e = PyList_GET_ITEM(fr, seq & fmask);
        if (e != NULL && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 4 && Py_REFCNT(e) == 1) {
            /* the entry it replaces is referenced by the ring alone: refilled in place */
            PyObject *items[4] = {seqo, code, p, n};
            for (int i = 0; i < 4; i++)
                Py_SETREF(PyTuple_GET_ITEM(e, i), Py_NewRef(items[i]));
            Py_DECREF(n);
        } else {
            e = PyTuple_Pack(4, seqo, code, p, n);
            Py_DECREF(n);
            if (e == NULL)
                goto done;
            PyList_SetItem(fr, seq & fmask, e);   /* (steals e) */
        }
    }
    {
        PyObject *ra[2] = {x, out};
        r = PyObject_Vectorcall(run, ra, 2, NULL);
    }
    if (r == NULL) {   /* the call is over on this rank: published as raised */
        raised(self, seq, code);
        goto done;
    }
    if (load(m + b + at_poison)) {   /* a peer's report arrived during the call */
        if (!(t = method_seq(self, s_poisoned_after, seq, code, NULL, NULL)))
            goto fail;
        Py_DECREF(t);
    }
    if (sh != NULL) {   /* the host neighbours' calls of this sequence number */
        long long kk = seq & 7;
        PyObject *more = SLOT(self, S_MORE);
        PyObject *trip[3] = {SLOT(self, S_P1), SLOT(self, S_P1B), SLOT(self, S_P1J)};
        Py_ssize_t nmore = (more != NULL && PyTuple_CheckExact(more)) ? PyTuple_GET_SIZE(more) : 0;
        for (Py_ssize_t i = -1; i < nmore; i++) {
            if (i >= 0) {
                PyObject *it = PyTuple_GET_ITEM(more, i);
                if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 3)
                    continue;
                trip[0] = PyTuple_GET_ITEM(it, 0);
                trip[1] = PyTuple_GET_ITEM(it, 1);
                trip[2] = PyTuple_GET_ITEM(it, 2);
            }
            Py_ssize_t np;
            long long pb;
            int64_t *pm = words(trip[0], &np);
            if (pm == NULL || as_ll(trip[1], &pb) || pb < 0 || pb + 8 > np || trip[2] == NULL) {
                PyErr_SetString(PyExc_ValueError, "mpicomm: a host neighbour's ring of calls is not an int64 memoryview");
                goto fail;
            }
            int64_t pw = load(pm + pb + kk);
            if (pw != w && (pw >> 32) == seq) {
                PyObject *pwo = PyLong_FromLongLong(pw);
                if (pwo == NULL)
                    goto fail;
                t = method_seq(self, s_differs, seq, code, trip[2], pwo);
                Py_DECREF(pwo);
                if (t == NULL)
                    goto fail;
                Py_DECREF(t);
            }
        }
    }
    store(m + b + at_done, v);
    int a = PyObject_IsTrue(async_op);
    if (a < 0)
        goto fail;
    if (a) {
        PyObject *s = PyLong_FromLongLong(seq);
        if (s == NULL)
            goto fail;
        PyObject *g = SLOT(self, S_GROUP), *wd = SLOT(self, S_WATCH);
        int bad = PyObject_SetAttr(r, s__group, g ? g : Py_None) || PyObject_SetAttr(r, s__seq, s)
                  || PyObject_SetAttr(r, s__watch, wd ? wd : Py_None);
        Py_DECREF(s);
        if (bad)
            goto fail;
    }
    goto done;
fail:
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

/* install(Dispatcher, Prepared, dropped, complete_dropped, at_done, at_poison) -> the method descriptor */
static PyObject *install(PyObject *mod, PyObject *args)
{
    PyObject *cls, *pcls, *dl, *cd;
    Py_ssize_t ad, ap;
    if (!PyArg_ParseTuple(args, "O!O!O!Onn", &PyType_Type, &cls, &PyType_Type, &pcls, &PyList_Type, &dl, &cd,
                          &ad, &ap))
        return NULL;
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
    at_done = ad;
    at_poison = ap;
    configured = 1;
    return PyDescr_NewMethod((PyTypeObject *)cls, &call_def);
}

/* ------------------------------------------------------------------ the NCCL run */

/* NcclRun: NCCLTransport._run's ``run(x, out)`` (mpicomm/_backends/nccl.py), with the same
 * fields: the array kind's accessors, the library call bound at prepare time, the role. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *transport, *comm, *lib, *run_any;   /* run_any: anything not taken as it comes */
    PyObject *contiguous, *device, *ptr;          /* the kind's accessors: array -> ... */
    PyObject *empty;                              /* () -> a new output (role NEW) */
    PyObject *get, *sptr;                         /* () -> current stream; stream -> cudaStream_t */
    PyObject *p0, *st0;                           /* the given stream= (p0 NULL: the current one) */
    PyObject *count, *nt, *e0, *e1;               /* the library call's count, type, op/root (or NULL) */
    PyObject *ocls, *dtype, *oshape, *what;
    PyObject *dev;                                /* this rank's GPU (an int) */
    PyObject *tdict;                              /* the transport's __dict__ (last_stream, last_what) */
    PyObject *cur_st, *cur_p;                     /* the current stream last seen, and its handle */
    intptr_t cur_ptr;
    intptr_t (*stream_ptr)(void);                 /* CuPy's own get_current_stream_ptr, or NULL */
    long dev_l;
    int role;                                     /* 0 new, 1 in place, 2 out= */
    int is_root;
    int cupy;                                     /* CuPy arrays: their attributes read here */
    long long xnb, onb, sx, so;
} NcclRun;

static PyObject *run_any(NcclRun *r, PyObject *x, PyObject *out)
{
    PyObject *a[2] = {x, out};
    return PyObject_Vectorcall(r->run_any, a, 2, NULL);
}

static inline PyObject *call1(PyObject *f, PyObject *a)
{
    return PyObject_Vectorcall(f, &a, 1, NULL);
}

/* CuPy: (x._c_contiguous and x.data.device_id == dev) -> 1/0 with *ptr = x.data.ptr (new
 * reference) when 1, -1 on an error; what the kind's accessors read, without their calls */
static int cupy_bind(NcclRun *r, PyObject *a, PyObject **ptr)
{
    PyObject *t = PyObject_GetAttr(a, s__c_contiguous);
    if (t == NULL)
        return -1;
    int ok = PyObject_IsTrue(t);
    Py_DECREF(t);
    if (ok != 1)
        return ok;
    PyObject *mp = PyObject_GetAttr(a, s_data);
    if (mp == NULL)
        return -1;
    t = PyObject_GetAttr(mp, s_device_id);
    if (t == NULL) {
        Py_DECREF(mp);
        return -1;
    }
    long d = PyLong_AsLong(t);
    Py_DECREF(t);
    if (d == -1 && PyErr_Occurred()) {
        Py_DECREF(mp);
        return -1;
    }
    if (d != r->dev_l) {
        Py_DECREF(mp);
        return 0;
    }
    *ptr = PyObject_GetAttr(mp, s_ptr);
    Py_DECREF(mp);
    return *ptr == NULL ? -1 : 1;
}

/* 1: array a is C-contiguous on this GPU, 0: it is not, -1: an error */
static int usable(NcclRun *r, PyObject *a)
{
    PyObject *t = call1(r->contiguous, a);
    if (t == NULL)
        return -1;
    int ok = PyObject_IsTrue(t);
    Py_DECREF(t);
    if (ok != 1)
        return ok;
    if (!(t = call1(r->device, a)))
        return -1;
    ok = PyObject_RichCompareBool(t, r->dev, Py_EQ);
    Py_DECREF(t);
    return ok;
}

/* a usable array's pointer: 1 with *ptr set, 0 (take run_any), -1 (an error) */
static inline int bind(NcclRun *r, PyObject *a, PyObject **ptr)
{
    if (r->cupy)
        return cupy_bind(r, a, ptr);
    int ok = usable(r, a);
    if (ok == 1 && !(*ptr = call1(r->ptr, a)))
        return -1;
    return ok;
}

/* the transport's attribute ``name`` set to ``v`` (a store only when it differs) */
static inline int keep(NcclRun *r, PyObject *name, PyObject *v)
{
    if (r->tdict != NULL) {
        if (PyDict_GetItemWithError(r->tdict, name) == v)
            return 0;
        if (PyErr_Occurred())
            return -1;
        return PyDict_SetItem(r->tdict, name, v);
    }
    return PyObject_SetAttr(r->transport, name, v);
}

/* the current stream (*st, the watchdog's) and its handle (*p), new references */
static int current_stream(NcclRun *r, PyObject **st, PyObject **p)
{
    if (r->stream_ptr != NULL) {   /* CuPy: its handle first; the Stream object as last time's */
        intptr_t h = r->stream_ptr();
        if (h == -1 && PyErr_Occurred())
            return -1;
        if (r->cur_st != NULL && h == r->cur_ptr) {
            *st = Py_NewRef(r->cur_st);
            *p = Py_NewRef(r->cur_p);
            return 0;
        }
    }
    if (!(*st = PyObject_CallNoArgs(r->get)))
        return -1;
    *p = PyLong_CheckExact(*st) ? Py_NewRef(*st) : call1(r->sptr, *st);
    if (*p == NULL) {
        Py_CLEAR(*st);
        return -1;
    }
    if (r->stream_ptr != NULL) {   /* (held here: the handle cannot be another stream's while it is) */
        intptr_t h = (intptr_t)PyLong_AsSsize_t(*p);
        if (h == -1 && PyErr_Occurred())
            PyErr_Clear();
        else {
            Py_XSETREF(r->cur_st, Py_NewRef(*st));
            Py_XSETREF(r->cur_p, Py_NewRef(*p));
            r->cur_ptr = h;
        }
    }
    return 0;
}

static PyObject *nccl_run_call(NcclRun *r, PyObject *x, PyObject *out)
{
    PyObject *xp = NULL, *op = NULL, *res = NULL, *st = NULL, *p = NULL, *t;
    int ok = bind(r, x, &xp);
    if (ok < 0)
        return NULL;
    if (!ok)
        return run_any(r, x, out);
    PyObject *comm = PyObject_GetAttr(r->transport, s_comm);
    if (comm == NULL)
        goto fail;
    Py_DECREF(comm);   /* (compared by identity only) */
    if (comm != r->comm) {
        Py_DECREF(xp);
        return run_any(r, x, out);
    }
    if (r->role == 0) {
        if (!(res = PyObject_CallNoArgs(r->empty)) || !(op = call1(r->ptr, res)))
            goto fail;
    } else if (r->role == 1) {
        res = Py_NewRef(x);
        op = Py_NewRef(xp);
    } else {
        int same = Py_TYPE(out) == (PyTypeObject *)r->ocls;
        if (same) {
            PyObject *dt = PyObject_GetAttr(out, s_dtype);
            if (dt == NULL)
                goto fail;
            same = dt == r->dtype ? 1 : PyObject_RichCompareBool(dt, r->dtype, Py_EQ);
            Py_DECREF(dt);
        }
        if (same == 1) {
            PyObject *sh = PyObject_GetAttr(out, s_shape);
            if (sh == NULL)
                goto fail;
            same = PyObject_RichCompareBool(sh, r->oshape, Py_EQ);
            Py_DECREF(sh);
        }
        if (same == 1)
            same = bind(r, out, &op);
        if (same < 0)
            goto fail;
        if (!same) {
            Py_DECREF(xp);
            return run_any(r, x, out);
        }
        long long a = PyLong_AsLongLong(xp), o = PyLong_AsLongLong(op);
        if (PyErr_Occurred())
            goto fail;
        /* out overlaps x (other than NCCL's own in-place forms): run_any says why */
        if (o < a + r->xnb && a < o + r->onb && !(o == a && r->onb == r->xnb) && o + r->sx != a
            && a + r->so != o) {
            Py_DECREF(xp);
            Py_DECREF(op);
            return run_any(r, x, out);
        }
        res = Py_NewRef(out);
    }
    if (r->p0 != NULL) {
        p = Py_NewRef(r->p0);
        st = Py_NewRef(r->st0);
    } else if (current_stream(r, &st, &p) < 0) {
        goto fail;
    }
    {
        PyObject *a[7] = {xp, op, r->count, r->nt, r->e0, r->e1, p};
        size_t n = 4;
        if (r->e1 != NULL) {          /* reduce: op, root */
            n = 7;
        } else if (r->e0 != NULL) {   /* all_reduce, reduce_scatter: op; broadcast: root */
            a[5] = p;
            n = 6;
        } else {                      /* all_gather */
            a[4] = p;
            n = 5;
        }
        if (!(t = PyObject_Vectorcall(r->lib, a, n, NULL)))
            goto fail;
        Py_DECREF(t);
    }
    if (keep(r, s_last_stream, st) || keep(r, s_last_what, r->what))
        goto fail;
    Py_DECREF(xp);
    Py_DECREF(op);
    Py_DECREF(st);
    Py_DECREF(p);
    if (!r->is_root) {
        Py_DECREF(res);
        Py_RETURN_NONE;
    }
    return res;
fail:
    Py_XDECREF(xp);
    Py_XDECREF(op);
    Py_XDECREF(res);
    Py_XDECREF(st);
    Py_XDECREF(p);
    return NULL;
}

static PyObject *nccl_run_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kw)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n != 2 || (kw != NULL && PyTuple_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "run(x, out) takes 2 positional arguments");
        return NULL;
    }
    return nccl_run_call((NcclRun *)self, args[0], args[1]);
}

static int nccl_run_traverse(NcclRun *r, visitproc visit, void *arg)
{
    Py_VISIT(r->transport); Py_VISIT(r->comm); Py_VISIT(r->lib); Py_VISIT(r->run_any);
    Py_VISIT(r->contiguous); Py_VISIT(r->device); Py_VISIT(r->ptr); Py_VISIT(r->empty);
    Py_VISIT(r->get); Py_VISIT(r->sptr); Py_VISIT(r->p0); Py_VISIT(r->st0); Py_VISIT(r->count);
    Py_VISIT(r->nt); Py_VISIT(r->e0); Py_VISIT(r->e1); Py_VISIT(r->ocls); Py_VISIT(r->dtype);
    Py_VISIT(r->oshape); Py_VISIT(r->what); Py_VISIT(r->dev); Py_VISIT(r->tdict); Py_VISIT(r->cur_st);
    Py_VISIT(r->cur_p);
    return 0;
}

static int nccl_run_clear(NcclRun *r)
{
    Py_CLEAR(r->transport); Py_CLEAR(r->comm); Py_CLEAR(r->lib); Py_CLEAR(r->run_any);
    Py_CLEAR(r->contiguous); Py_CLEAR(r->device); Py_CLEAR(r->ptr); Py_CLEAR(r->empty);
    Py_CLEAR(r->get); Py_CLEAR(r->sptr); Py_CLEAR(r->p0); Py_CLEAR(r->st0); Py_CLEAR(r->count);
    Py_CLEAR(r->nt); Py_CLEAR(r->e0); Py_CLEAR(r->e1); Py_CLEAR(r->ocls); Py_CLEAR(r->dtype);
    Py_CLEAR(r->oshape); Py_CLEAR(r->what); Py_CLEAR(r->dev); Py_CLEAR(r->tdict); Py_CLEAR(r->cur_st);
    Py_CLEAR(r->cur_p);
    return 0;
}

static void nccl_run_dealloc(NcclRun *r)
{
    PyObject_GC_UnTrack(r);
    nccl_run_clear(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *nccl_run_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"transport", "comm", "lib", "run_any", "contiguous", "device", "ptr", "empty",
                            "get", "sptr", "p0", "st0", "count", "nt", "e0", "e1", "ocls", "dtype", "oshape",
                            "what", "dev", "role", "is_root", "xnb", "onb", "sx", "so", "cupy", "stream_ptr", NULL};
    PyObject *o[21], *sp = Py_None;
    int role, is_root, cupy = 0;
    long long xnb, onb, sx, so;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOOOOOOOOOOOipLLLL|pO", names, &o[0], &o[1], &o[2], &o[3],
                                     &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13],
                                     &o[14], &o[15], &o[16], &o[17], &o[18], &o[19], &o[20], &role, &is_root,
                                     &xnb, &onb, &sx, &so, &cupy, &sp))
        return NULL;
    intptr_t (*fn)(void) = NULL;
    if (sp != Py_None) {   /* CuPy's get_current_stream_ptr, exported by its Cython module */
        const char *sig = PyCapsule_IsValid(sp, PyCapsule_GetName(sp)) ? PyCapsule_GetName(sp) : NULL;
        /* anything but a function of that signature: the current stream as the Python path gets it */
        if (sig != NULL && strstr(sig, "intptr_t") != NULL && strstr(sig, "(void)") != NULL)
            fn = (intptr_t(*)(void))PyCapsule_GetPointer(sp, sig);
        PyErr_Clear();
    }
    long dev_l = PyLong_AsLong(o[20]);
    if (dev_l == -1 && PyErr_Occurred())
        return NULL;
    if (role < 0 || role > 2)
        return PyErr_Format(PyExc_ValueError, "role %d: 0 (new), 1 (in place) or 2 (out=)", role);
    NcclRun *r = PyObject_GC_New(NcclRun, type);
    if (r == NULL)
        return NULL;
    PyObject **f[21] = {&r->transport, &r->comm, &r->lib, &r->run_any, &r->contiguous, &r->device, &r->ptr,
                        &r->empty, &r->get, &r->sptr, &r->p0, &r->st0, &r->count, &r->nt, &r->e0, &r->e1,
                        &r->ocls, &r->dtype, &r->oshape, &r->what, &r->dev};
    for (int i = 0; i < 21; i++)   /* None: absent (p0/st0: the current stream; e0/e1: no op/root) */
        *f[i] = (o[i] == Py_None && (i == 10 || i == 14 || i == 15)) ? NULL : Py_NewRef(o[i]);
    r->tdict = PyObject_GenericGetDict(r->transport, NULL);   /* (NULL: set as attributes) */
    if (r->tdict == NULL)
        PyErr_Clear();
    r->cur_st = r->cur_p = NULL;
    r->cur_ptr = 0;
    r->stream_ptr = fn;
    r->dev_l = dev_l;
    r->cupy = cupy;
    r->role = role;
    r->is_root = is_root;
    r->xnb = xnb;
    r->onb = onb;
    r->sx = sx;
    r->so = so;
    r->vectorcall = nccl_run_vectorcall;
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

static PyObject *nccl_run_tp_call(PyObject *self, PyObject *args, PyObject *kw)
{
    return PyVectorcall_Call(self, args, kw);
}

static PyTypeObject NcclRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicomm._native._callpath.NcclRun",
    .tp_doc = "NcclRun(**fields)(x, out): a blocking NCCL collective's run (mpicomm/_backends/nccl.py _run), compiled",
    .tp_basicsize = sizeof(NcclRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(NcclRun, vectorcall),
    .tp_call = nccl_run_tp_call,
    .tp_new = nccl_run_new,
    .tp_traverse = (traverseproc)nccl_run_traverse,
    .tp_clear = (inquiry)nccl_run_clear,
    .tp_dealloc = (destructor)nccl_run_dealloc,
};

/* ------------------------------------------------------------------ the public functions */

/* Public: a public collective (mpicomm._collectives) whose common case is read here: its
 * arguments bound to their parameters, the world group (group=None), a ReduceOp op and the
 * parameters that must be None for it (sizes=...), then ``CTX.world.call(code, x, out, arg,
 * async_op, stream)`` as the Python function makes it. Anything else (another group, an op
 * given as a string, sizes, an argument error, before init) calls the Python function,
 * which is also its __wrapped__ (signature, docstring). */
#define MAXP 8
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *func, *names, *defaults, *code, *ctx, *reduceop;
    int np, ix, iout, iarg, igroup, iasync, istream, iop, nnone;
    int none[MAXP];
} Public;

static PyObject *s_world, *s_call;

static PyObject *public_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Public *f = (Public *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    PyObject *v[MAXP];
    if (n > f->np)
        goto slow;
    for (int i = 0; i < f->np; i++)
        v[i] = i < n ? args[i] : NULL;
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t j = 0; j < nk; j++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, j);
            int k = 0;
            while (k < f->np && PyTuple_GET_ITEM(f->names, k) != name)
                k++;
            if (k == f->np || v[k] != NULL)   /* (a name not interned, unknown, or given twice) */
                goto slow;
            v[k] = args[n + j];
        }
    }
    for (int i = 0; i < f->np; i++)
        if (v[i] == NULL) {
            if (i == f->ix)
                goto slow;
            v[i] = PyTuple_GET_ITEM(f->defaults, i);
        }
    if (v[f->igroup] != Py_None || (f->iop >= 0 && Py_TYPE(v[f->iop]) != (PyTypeObject *)f->reduceop))
        goto slow;
    for (int i = 0; i < f->nnone; i++)
        if (v[f->none[i]] != Py_None)
            goto slow;
    PyObject *world = PyObject_GetAttr(f->ctx, s_world);
    if (world == NULL)
        return NULL;
    if (world == Py_None) {
        Py_DECREF(world);
        goto slow;
    }
    PyObject *call = PyObject_GetAttr(world, s_call);
    Py_DECREF(world);
    if (call == NULL)
        return NULL;
    if (call == Py_None) {
        Py_DECREF(call);
        goto slow;
    }
    PyObject *a[6] = {f->code, v[f->ix], f->iout >= 0 ? v[f->iout] : Py_None,
                      f->iarg >= 0 ? v[f->iarg] : Py_None, v[f->iasync], v[f->istream]};
    PyObject *r = PyObject_Vectorcall(call, a, 6, NULL);
    Py_DECREF(call);
    return r;
slow:
    return PyObject_Vectorcall(f->func, args, nargsf, kwnames);
}

static int public_index(PyObject *names, PyObject *name, int *out)
{
    if (name == Py_None) {
        *out = -1;
        return 0;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(names); k++) {
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, k), name, Py_EQ);
        if (eq < 0)
            return -1;
        if (eq) {
            *out = (int)k;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "%R is not one of the parameters %R", name, names);
    return -1;
}

/* Public(func, code, ctx, reduceop, x=, out=, arg=, group=, async_op=, stream=, op=, none=())
 * with the parameters named as func names them (out/arg/op None: it has none) */
static PyObject *public_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"func", "code", "ctx", "reduceop", "x", "out", "arg", "group", "async_op", "stream",
                          "op", "none", NULL};
    PyObject *func, *code, *ctx, *reduceop, *nx, *nout, *narg, *ngroup, *nasync, *nstream, *nop, *none;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO$OOOOOOOO", kwl, &func, &code, &ctx, &reduceop, &nx, &nout,
                                     &narg, &ngroup, &nasync, &nstream, &nop, &none))
        return NULL;
    /* the parameters and their defaults, from the function */
    PyObject *c = PyObject_GetAttrString(func, "__code__");
    PyObject *defs = c ? PyObject_GetAttrString(func, "__defaults__") : NULL;
    PyObject *kwdefs = defs ? PyObject_GetAttrString(func, "__kwdefaults__") : NULL;
    PyObject *varnames = kwdefs ? PyObject_GetAttrString(c, "co_varnames") : NULL;
    PyObject *argc = varnames ? PyObject_GetAttrString(c, "co_argcount") : NULL;
    PyObject *kwonly = argc ? PyObject_GetAttrString(c, "co_kwonlyargcount") : NULL;
    Public *f = NULL;
    if (kwonly == NULL)
        goto done;
    Py_ssize_t na = PyLong_AsSsize_t(argc), nk = PyLong_AsSsize_t(kwonly);
    if (nk != 0 || na > MAXP || na < 1 || !PyTuple_Check(varnames) || !PyTuple_Check(defs)
        || PyTuple_GET_SIZE(defs) != na - 1) {
        PyErr_Format(PyExc_TypeError, "Public: %R is not a function (x, ...) whose other parameters have defaults", func);
        goto done;
    }
    f = PyObject_GC_New(Public, type);
    if (f == NULL)
        goto done;
    f->dict = PyDict_New();
    f->names = PyTuple_New(na);
    f->defaults = PyTuple_New(na);
    f->func = Py_NewRef(func);
    f->code = Py_NewRef(code);
    f->ctx = Py_NewRef(ctx);
    f->reduceop = Py_NewRef(reduceop);
    f->np = (int)na;
    f->nnone = 0;
    f->vectorcall = public_vectorcall;
    PyObject_GC_Track(f);
    if (f->dict == NULL || f->names == NULL || f->defaults == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *nm = PyTuple_GET_ITEM(varnames, i);
        Py_INCREF(nm);
        PyUnicode_InternInPlace(&nm);
        PyTuple_SET_ITEM(f->names, i, nm);
        PyTuple_SET_ITEM(f->defaults, i, Py_NewRef(i == 0 ? Py_None : PyTuple_GET_ITEM(defs, i - 1)));
    }
    if (public_index(f->names, nx, &f->ix) || public_index(f->names, nout, &f->iout)
        || public_index(f->names, narg, &f->iarg) || public_index(f->names, ngroup, &f->igroup)
        || public_index(f->names, nasync, &f->iasync) || public_index(f->names, nstream, &f->istream)
        || public_index(f->names, nop, &f->iop))
        goto fail;
    if (f->ix != 0 || f->igroup < 0 || f->iasync < 0 || f->istream < 0) {
        PyErr_SetString(PyExc_ValueError, "Public: x first; group, async_op and stream named");
        goto fail;
    }
    PyObject *seq = PySequence_Fast(none, "none: a sequence of parameter names");
    if (seq == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && i < MAXP; i++) {
        if (public_index(f->names, PySequence_Fast_GET_ITEM(seq, i), &f->none[f->nnone])) {
            Py_DECREF(seq);
            goto fail;
        }
        f->nnone++;
    }
    Py_DECREF(seq);
    /* what a function shows: its name, docstring and signature (through __wrapped__) */
    static const char *copied[] = {"__name__", "__qualname__", "__module__", "__doc__", "__annotations__", NULL};
    for (int i = 0; copied[i]; i++) {
        PyObject *a = PyObject_GetAttrString(func, copied[i]);
        if (a == NULL || PyDict_SetItemString(f->dict, copied[i], a)) {
            Py_XDECREF(a);
            goto fail;
        }
        Py_DECREF(a);
    }
    if (PyDict_SetItemString(f->dict, "__wrapped__", func))
        goto fail;
    goto done;
fail:
    Py_CLEAR(f);
done:
    Py_XDECREF(c);
    Py_XDECREF(defs);
    Py_XDECREF(kwdefs);
    Py_XDECREF(varnames);
    Py_XDECREF(argc);
    Py_XDECREF(kwonly);
    return (PyObject *)f;
}

static int public_traverse(Public *f, visitproc visit, void *arg)
{
    Py_VISIT(f->dict); Py_VISIT(f->func); Py_VISIT(f->names); Py_VISIT(f->defaults); Py_VISIT(f->code);
    Py_VISIT(f->ctx); Py_VISIT(f->reduceop);
    return 0;
}

static int public_clear(Public *f)
{
    Py_CLEAR(f->dict); Py_CLEAR(f->func); Py_CLEAR(f->names); Py_CLEAR(f->defaults); Py_CLEAR(f->code);
    Py_CLEAR(f->ctx); Py_CLEAR(f->reduceop);
    return 0;
}

static void public_dealloc(Public *f)
{
    PyObject_GC_UnTrack(f);
    public_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *public_repr(Public *f)
{
    PyObject *q = PyObject_GetAttrString(f->func, "__qualname__");
    if (q == NULL)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("<function %S (common case compiled)>", q);
    Py_DECREF(q);
    return r;
}

static PyTypeObject PublicType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpicomm._native._callpath.Public",
    .tp_doc = "Public(func, code, ctx, reduceop, ...): a public collective with its common case compiled",
    .tp_basicsize = sizeof(Public),
    .tp_dictoffset = offsetof(Public, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Public, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = public_new,
    .tp_repr = (reprfunc)public_repr,
    .tp_traverse = (traverseproc)public_traverse,
    .tp_clear = (inquiry)public_clear,
    .tp_dealloc = (destructor)public_dealloc,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"install", install, METH_VARARGS,
     "install(Dispatcher, Prepared, dropped, complete_dropped, AT_DONE, AT_POISON) -> the compiled call method "
     "(a method descriptor of Dispatcher)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_callpath",
    "mpicomm's call path in C (see mpicomm/_native/_callpath.c)", -1, module_methods};

PyMODINIT_FUNC PyInit__callpath(void)
{
    if (intern_all() < 0 || PyType_Ready(&NcclRunType) < 0 || PyType_Ready(&PublicType) < 0
        || !(s_world = PyUnicode_InternFromString("world")) || !(s_call = PyUnicode_InternFromString("call")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifndef MPICOMM_SOURCE
#define MPICOMM_SOURCE ""
#endif
    if (PyModule_AddObjectRef(m, "NcclRun", (PyObject *)&NcclRunType) < 0
        || PyModule_AddObjectRef(m, "Public", (PyObject *)&PublicType) < 0
        || PyModule_AddStringConstant(m, "SOURCE", MPICOMM_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
