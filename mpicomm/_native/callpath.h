/* What the compiled call path's files share (the module: _callpath.c). */
#ifndef MPICOMM_CALLPATH_H
#define MPICOMM_CALLPATH_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define INTERN(v, s) if (!(v = PyUnicode_InternFromString(s))) return -1

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

static inline PyObject *call1(PyObject *f, PyObject *a)
{
    return PyObject_Vectorcall(f, &a, 1, NULL);
}

/* each file's types and interned names, set up by the module's init */
int dispatch_init(PyObject *m);
int nccl_run_init(PyObject *m);
int public_init(PyObject *m);
PyObject *install(PyObject *mod, PyObject *args);
PyObject *key_matches_py(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *crash_watch(PyObject *mod, PyObject *args);   /* crash.c: the crash report */
PyObject *crash_name(PyObject *mod, PyObject *args);
PyObject *crash_unwatch(PyObject *mod, PyObject *noargs);

#endif
