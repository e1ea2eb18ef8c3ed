/* The public collectives' common case (mpicomm/_collectives.py), compiled: see _callpath.c. */
#include "callpath.h"

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

/* what a function shows: its name, docstring and signature (through __wrapped__) */
static int public_show(Public *f, PyObject *func)
{
    static const char *copied[] = {"__name__", "__qualname__", "__module__", "__doc__", "__annotations__", NULL};
    for (int i = 0; copied[i]; i++) {
        PyObject *a = PyObject_GetAttrString(func, copied[i]);
        if (a == NULL || PyDict_SetItemString(f->dict, copied[i], a)) {
            Py_XDECREF(a);
            return -1;
        }
        Py_DECREF(a);
    }
    return PyDict_SetItemString(f->dict, "__wrapped__", func);
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
    PyObject *given[7] = {nx, nout, narg, ngroup, nasync, nstream, nop};
    int *index[7] = {&f->ix, &f->iout, &f->iarg, &f->igroup, &f->iasync, &f->istream, &f->iop};
    for (int i = 0; i < 7; i++)
        if (public_index(f->names, given[i], index[i]))
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
    if (public_show(f, func) < 0)
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


int public_init(PyObject *m)
{
    INTERN(s_world, "world"); INTERN(s_call, "call");
    if (PyType_Ready(&PublicType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "Public", (PyObject *)&PublicType);
}
