/* mpicomm's call path in C: Dispatcher.call's common case, the NCCL run of a blocking
 * collective on CuPy arrays or PyTorch tensors, and the public collectives' common case.
 *
 * Each is the Python code it replaces, step for step (dispatch.c: mpicomm/_dispatch.py
 * Dispatcher.call; nccl_run.c: mpicomm/_backends/nccl.py NCCLTransport._run; public.c:
 * mpicomm/_collectives.py all_reduce, all_gather, reduce_scatter, broadcast), written out in C
 * because at 8 bytes a collective's time over the library's is its Python. Anything
 * but the common case goes back to the Python it mirrors before any side effect: a
 * new signature (call_new), a report word set (poisoned), an error in the call
 * (raise_in_call), an array the NCCL run does not take as it comes (run_any).
 *
 * The dispatcher's state stays in the Python object: this module reads its __slots__
 * at their offsets (found once, from the class's member descriptors), so Python and C
 * see one sequence number and one set of progress words. MPICOMM_NATIVE=0 leaves the
 * Python path in place (mpicomm/_native/__init__.py).
 *
 * Beside them, crash.c: the crash report (a fatal signal in a rank names the call it was in),
 * which needs C because it runs in a signal handler.
 */
#include "callpath.h"

static PyMethodDef module_methods[] = {
    {"install", install, METH_VARARGS,
     "install(Dispatcher, Prepared, dropped, complete_dropped, layout) -> the compiled call method (a method "
     "descriptor of Dispatcher); layout: {name: int} of the progress words' layout "
     "(mpicomm._dispatch.NATIVE_LAYOUT)"},
    {"key_matches", (PyCFunction)(void (*)(void))key_matches_py, METH_FASTCALL,
     "key_matches(key, x, out, arg, async_op, stream) -> whether the compiled call reuses the prepared call of "
     "``key`` (mpicomm._dispatch.call_key) for these arguments"},
    {"crash_watch", crash_watch, METH_VARARGS,
     "crash_watch(words, rank, layout, names): on a fatal signal, say which call the rank was in, from its "
     "progress window ``words`` (crash.c)"},
    {"crash_name", crash_name, METH_VARARGS, "crash_name(group_hash, name): the group's name in the crash report"},
    {"crash_unwatch", crash_unwatch, METH_NOARGS, "crash_unwatch(): the signal handlers that were there before"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_callpath",
    "mpicomm's call path in C (see mpicomm/_native/_callpath.c)", -1, module_methods};

#ifndef MPICOMM_SOURCE
#define MPICOMM_SOURCE ""
#endif

PyMODINIT_FUNC PyInit__callpath(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (dispatch_init(m) < 0 || nccl_run_init(m) < 0 || public_init(m) < 0
        || PyModule_AddStringConstant(m, "SOURCE", MPICOMM_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
