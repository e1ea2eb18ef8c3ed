/* The NCCL transport's run of a blocking collective (mpicomm/_backends/nccl.py _run), compiled:
 * see _callpath.c. */
#include "callpath.h"

static PyObject *s__c_contiguous, *s_data, *s_device_id, *s_ptr, *s_shape, *s_dtype, *s_last_stream,
    *s_last_what, *s_comm;

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

/* A given out=: 1 with its pointer in *op when the first call's kind of array (class, dtype,
 * shape, contiguous on this GPU) and not overlapping x (at xp) other than in NCCL's own in-place
 * forms; 0 when not (run_any says why); -1 on an error. */
static int given_out(NcclRun *r, PyObject *xp, PyObject *out, PyObject **op)
{
    if (Py_TYPE(out) != (PyTypeObject *)r->ocls)
        return 0;
    PyObject *t = PyObject_GetAttr(out, s_dtype);
    if (t == NULL)
        return -1;
    int same = t == r->dtype ? 1 : PyObject_RichCompareBool(t, r->dtype, Py_EQ);
    Py_DECREF(t);
    if (same == 1) {
        if (!(t = PyObject_GetAttr(out, s_shape)))
            return -1;
        same = PyObject_RichCompareBool(t, r->oshape, Py_EQ);
        Py_DECREF(t);
    }
    if (same == 1)
        same = bind(r, out, op);
    if (same != 1)
        return same;
    long long a = PyLong_AsLongLong(xp), o = PyLong_AsLongLong(*op);
    if (PyErr_Occurred()) {
        Py_CLEAR(*op);
        return -1;
    }
    if (o < a + r->xnb && a < o + r->onb && !(o == a && r->onb == r->xnb) && o + r->sx != a && a + r->so != o) {
        Py_CLEAR(*op);
        return 0;
    }
    return 1;
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
        int same = given_out(r, xp, out, &op);
        if (same < 0)
            goto fail;
        if (!same) {
            Py_DECREF(xp);
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

/* every object field, once: what the garbage collector visits and what clear drops */
#define NCCL_RUN_OBJECTS(X) X(transport) X(comm) X(lib) X(run_any) X(contiguous) X(device) X(ptr) X(empty) \
    X(get) X(sptr) X(p0) X(st0) X(count) X(nt) X(e0) X(e1) X(ocls) X(dtype) X(oshape) X(what) X(dev) \
    X(tdict) X(cur_st) X(cur_p)

static int nccl_run_traverse(NcclRun *r, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(r->f);
    NCCL_RUN_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int nccl_run_clear(NcclRun *r)
{
#define CLEAR(f) Py_CLEAR(r->f);
    NCCL_RUN_OBJECTS(CLEAR)
#undef CLEAR
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


int nccl_run_init(PyObject *m)
{
    INTERN(s__c_contiguous, "_c_contiguous"); INTERN(s_data, "data"); INTERN(s_device_id, "device_id");
    INTERN(s_ptr, "ptr"); INTERN(s_shape, "shape"); INTERN(s_dtype, "dtype"); INTERN(s_last_stream, "last_stream");
    INTERN(s_last_what, "last_what"); INTERN(s_comm, "comm");
    if (PyType_Ready(&NcclRunType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "NcclRun", (PyObject *)&NcclRunType);
}
