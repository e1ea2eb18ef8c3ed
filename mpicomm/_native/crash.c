/* The crash report: a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) in a rank says,
 * before the process dies, which of mpicomm's calls it was in (or its last one), from the
 * rank's progress window (mpicomm/_reliability/progress.py), and marks the window as left
 * with status 128 + the signal, as a rank leaving its script does, so that peers that go on
 * waiting name it. Everything here runs in the signal handler: reads of the window's words
 * and write(2) of text formatted by hand (async-signal-safe), then the handler that was
 * there before (faulthandler's Python stacks, Open MPI's, or the default action).
 *
 * The case it is for: ranks whose counts differ in an all_reduce can make MPI write past a
 * buffer (Open MPI 5 at 2000 against 2100 float32: "double free or corruption", SIGABRT),
 * before mpicomm compares the calls. */
#include "callpath.h"
#include <signal.h>
#include <unistd.h>

static const int fatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
#define NFATAL ((int)(sizeof(fatal) / sizeof(fatal[0])))
static struct sigaction before[NFATAL];
static int installed = 0;
static volatile sig_atomic_t reported = 0;

static Py_buffer win;                 /* the progress window's words (int64), held while watched */
static int64_t *m = NULL;
static Py_ssize_t nwords = 0;
static long rank = -1;
static pid_t watched_pid = 0;          /* a forked child (a DataLoader worker) reports nothing */
static Py_ssize_t hdr, fields, rows, f_ghash, f_entered, f_done, f_tdone, w_exited, w_xstatus;

#define NNAMES 16
#define NAMELEN 24
static char op_names[NNAMES][NAMELEN];   /* collective code -> name (mpicomm._ops.NAMES) */
#define NGROUPS 256
#define GROUPLEN 48
static struct { int64_t gh; char name[GROUPLEN]; } groups[NGROUPS];   /* group hash -> name */

/* ------------------------------------------------------------------ signal-safe text */

typedef struct { char b[768]; size_t n; } Text;

static void put(Text *t, const char *s)
{
    while (*s && t->n < sizeof(t->b) - 1)
        t->b[t->n++] = *s++;
}

static void put_int(Text *t, long long v)
{
    char d[24];
    int k = 0;
    unsigned long long u = v < 0 ? -(unsigned long long)v : (unsigned long long)v;
    do {
        d[k++] = (char)('0' + u % 10);
        u /= 10;
    } while (u && k < 23);
    if (v < 0)
        d[k++] = '-';
    while (k && t->n < sizeof(t->b) - 1)
        t->b[t->n++] = d[--k];
}

static const char *signame(int sig)
{
    switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    default: return "a fatal signal";
    }
}

/* "all_reduce sequence 2 on group 'world'" for a row's ENTERED word */
static void put_call(Text *t, int64_t word, int64_t gh)
{
    int code = (int)(word & 15);
    put(t, code < NNAMES && op_names[code][0] ? op_names[code] : "a collective");
    put(t, " sequence ");
    put_int(t, (long long)(word >> 4));
    put(t, " on group ");
    for (int i = 0; i < NGROUPS; i++)
        if (groups[i].name[0] && groups[i].gh == gh) {
            put(t, "'");
            put(t, groups[i].name);
            put(t, "'");
            return;
        }
    put(t, "#");
    put_int(t, (long long)gh);
}

static void report(int sig)
{
    Text t = {.n = 0};
    put(&t, "[mpicomm rank ");
    put_int(&t, rank);
    put(&t, "] fatal signal ");
    put_int(&t, sig);
    put(&t, " (");
    put(&t, signame(sig));
    put(&t, ") ");
    Py_ssize_t inside = -1, last = -1;
    int64_t last_t = -1;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t b = hdr + r * fields;
        if (b + fields > nwords || !m[b + f_ghash] || !m[b + f_entered])
            continue;
        if (m[b + f_entered] != m[b + f_done] && inside < 0)
            inside = b;
        if (m[b + f_tdone] > last_t) {
            last_t = m[b + f_tdone];
            last = b;
        }
    }
    if (inside >= 0) {
        put(&t, "inside ");
        put_call(&t, m[inside + f_entered], m[inside + f_ghash]);
    } else {
        put(&t, "outside mpicomm's calls");
        if (last >= 0) {
            put(&t, " (its last: ");
            put_call(&t, m[last + f_done], m[last + f_ghash]);
            put(&t, ")");
        }
    }
    put(&t, ". Where the ranks' calls differ (count, dtype, op), MPI can write past a buffer before mpicomm "
            "compares them: MPICOMM_DEBUG=1 compares every call's arguments before it runs\n");
    ssize_t w = write(2, t.b, t.n);
    (void)w;
}

static void handler(int sig, siginfo_t *info, void *ctx)
{
    int i = 0;
    while (i < NFATAL && fatal[i] != sig)
        i++;
    if (!reported && m != NULL && getpid() == watched_pid) {
        reported = 1;
        report(sig);
        if (w_xstatus < nwords && w_exited < nwords) {   /* peers that go on waiting name it */
            __atomic_store_n(m + w_xstatus, (int64_t)(128 + sig + 1), __ATOMIC_RELEASE);
            __atomic_store_n(m + w_exited, (int64_t)1, __ATOMIC_RELEASE);
        }
    }
    if (i == NFATAL)
        return;
    /* the handler that was there before, as if this one had not been */
    struct sigaction *old = &before[i];
    if (old->sa_flags & SA_SIGINFO) {
        if (old->sa_sigaction != NULL) {
            old->sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (old->sa_handler == SIG_IGN) {
        return;
    } else if (old->sa_handler != SIG_DFL && old->sa_handler != NULL) {
        old->sa_handler(sig);
        return;
    }
    /* the default action: restored, and the signal raised again (a fault re-runs the
     * faulting instruction on return and takes it then) */
    signal(sig, SIG_DFL);
    if (info == NULL || info->si_code <= 0 || sig == SIGABRT)
        raise(sig);
}

/* ------------------------------------------------------------------ from Python */

static void unwatch_now(void)
{
    if (installed) {   /* (where a handler installed after this one chains to it, it stays: this one
                        * then only passes the signal on) */
        for (int i = 0; i < NFATAL; i++) {
            struct sigaction now;
            if (sigaction(fatal[i], NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == handler)
                sigaction(fatal[i], &before[i], NULL);
        }
        installed = 0;
    }
    if (m != NULL) {
        m = NULL;
        PyBuffer_Release(&win);
    }
}

/* crash_watch(words, rank, layout, names): report fatal signals from the progress window
 * ``words`` (int64, writable); layout: {name: int} (HDR, F, ROWS, GHASH, ENTERED, DONE, TDONE,
 * EXITED, XSTATUS); names: the collectives' names by code */
PyObject *crash_watch(PyObject *mod, PyObject *args)
{
    PyObject *words_obj, *lay, *names;
    long r;
    if (!PyArg_ParseTuple(args, "OlO!O!", &words_obj, &r, &PyDict_Type, &lay, &PyList_Type, &names))
        return NULL;
    const char *keys[] = {"HDR", "F", "ROWS", "GHASH", "ENTERED", "DONE", "TDONE", "EXITED", "XSTATUS"};
    Py_ssize_t *dst[] = {&hdr, &fields, &rows, &f_ghash, &f_entered, &f_done, &f_tdone, &w_exited, &w_xstatus};
    Py_ssize_t vals[9];
    for (int i = 0; i < 9; i++) {
        PyObject *v = PyDict_GetItemString(lay, keys[i]);
        if (v == NULL || !PyLong_Check(v) || (vals[i] = PyLong_AsSsize_t(v)) < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "crash_watch(): layout[%s] is not an integer >= 0", keys[i]);
            return NULL;
        }
    }
    unwatch_now();
    Py_buffer b;
    if (PyObject_GetBuffer(words_obj, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (b.itemsize != 8 || b.len % 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "crash_watch(): the words are not int64");
        return NULL;
    }
    for (int i = 0; i < 9; i++)
        *dst[i] = vals[i];
    memset(op_names, 0, sizeof(op_names));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(names) && i < NNAMES; i++) {
        const char *s = PyUnicode_Check(PyList_GET_ITEM(names, i)) ? PyUnicode_AsUTF8(PyList_GET_ITEM(names, i)) : NULL;
        if (s == NULL) {
            PyErr_Clear();
            continue;
        }
        strncpy(op_names[i], s, NAMELEN - 1);
    }
    win = b;
    nwords = b.len / 8;
    rank = r;
    reported = 0;
    watched_pid = getpid();
    m = (int64_t *)b.buf;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < NFATAL; i++)
        sigaction(fatal[i], &sa, &before[i]);
    installed = 1;
    Py_RETURN_NONE;
}

/* crash_name(group_hash, name): the name the report gives the group of that hash */
PyObject *crash_name(PyObject *mod, PyObject *args)
{
    long long gh;
    const char *name;
    if (!PyArg_ParseTuple(args, "Ls", &gh, &name))
        return NULL;
    int free_slot = -1;
    for (int i = 0; i < NGROUPS; i++) {
        if (groups[i].name[0] && groups[i].gh == gh)
            free_slot = i;
        else if (!groups[i].name[0] && free_slot < 0)
            free_slot = i;
    }
    if (free_slot >= 0) {
        groups[free_slot].name[0] = 0;
        groups[free_slot].gh = gh;
        strncpy(groups[free_slot].name, name, GROUPLEN - 1);
        groups[free_slot].name[GROUPLEN - 1] = 0;
    }
    Py_RETURN_NONE;
}

/* crash_unwatch(): the handlers that were there before, and the window let go */
PyObject *crash_unwatch(PyObject *mod, PyObject *noargs)
{
    unwatch_now();
    Py_RETURN_NONE;
}
