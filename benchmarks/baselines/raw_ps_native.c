/* baselines/raw_ps.py --native: the raw parameter server's per-part loop compiled, both ends.
 *
 * The same schedule and work as raw_ps.py --parts (its module docstring), with the loop that handles a part
 * in C instead of Python: on a server, one thread a worker reads that worker's parts (a 4-byte part number,
 * then the part's bytes straight into that worker's gradient buffer), checks each for inf/nan, and the thread
 * of a part's last copy sums the copies, takes the SGD step, copies the part's weights into the answer buffer
 * and sends them to every worker (number and bytes, one sendmsg). On a worker, one call a step: the gradient
 * checked, the parts sent in the given order at most ``window`` unanswered, one thread a server reading the
 * answers straight into the parameters. Python sets up the sockets and the first weights; every step runs
 * here, without the interpreter's lock (ctypes lets it go for the call).
 *
 * ``rps_serve``'s ``step``, where given: a function called (from the serving thread, taking the
 * interpreter's lock through ctypes) with a part's number once every copy of it is in, to sum, step and copy
 * that part itself in place of the C loops; it returns 0, or not 0 to fail. The answer is sent by C after.
 *
 * Sockets are made blocking with the kernel's deadlines (SO_RCVTIMEO, SO_SNDTIMEO), so every wait is bounded
 * by ``timeout_ms``. A failure returns -1 with its reason in ``rps_error``.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

char rps_error[512];
static pthread_mutex_t error_lock = PTHREAD_MUTEX_INITIALIZER;

static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&error_lock);
    if (!rps_error[0]) vsnprintf(rps_error, sizeof rps_error, fmt, ap);
    pthread_mutex_unlock(&error_lock);
    va_end(ap);
    return -1;
}

static int prepare(int fd, int timeout_ms) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0) return fail("fcntl: %s", strerror(errno));
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) < 0)
        return fail("setsockopt: %s", strerror(errno));
    return 0;
}

static int read_full(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n) {
        ssize_t r = recv(fd, p, n, MSG_WAITALL);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
        } else if (r == 0) {
            return fail("the peer closed the connection");
        } else if (errno != EINTR) {
            return fail("recv: %s", strerror(errno));
        }
    }
    return 0;
}

/* A part's number and bytes in one sendmsg where the socket takes them. */
static int send_part(int fd, uint32_t part, const void *body, size_t nbytes) {
    uint32_t head = htonl(part);
    struct iovec iov[2] = {{&head, sizeof head}, {(void *)body, nbytes}};
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    while (msg.msg_iovlen) {
        ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return fail("sendmsg: %s", strerror(errno));
        }
        while (msg.msg_iovlen && (size_t)w >= msg.msg_iov[0].iov_len) {
            w -= (ssize_t)msg.msg_iov[0].iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen) {
            msg.msg_iov[0].iov_base = (char *)msg.msg_iov[0].iov_base + w;
            msg.msg_iov[0].iov_len -= (size_t)w;
        }
    }
    return 0;
}

/* No inf or nan: no element with every exponent bit set (the loop vectorizes; a float sum would not). */
static int all_finite(const float *x, long n) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t bad = 0;
    for (long i = 0; i < n; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
    return !bad;
}

static void deadline_in(struct timespec *ts, int timeout_ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += timeout_ms / 1000;
    ts->tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void cond_init(pthread_cond_t *cv) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
}

/* ---- the server ---- */

typedef struct {
    int world, parts;
    long rounds;
    const int *fds;
    float *weights, *answer, *total;
    float *const *grads; /* a buffer a worker, each the server's whole range */
    const long *lo, *hi; /* each part's elements [lo, hi) of the range */
    float lr;
    int (*step)(int part);
    int *counts;
    pthread_mutex_t lock;
    pthread_mutex_t *sending; /* one a worker's socket */
    volatile int failed;
} server_t;

typedef struct {
    server_t *s;
    int rank;
    int rc;
} serve_arg_t;

static int arrived(server_t *s, uint32_t part) {
    pthread_mutex_lock(&s->lock);
    int done = ++s->counts[part] == s->world;
    if (done) s->counts[part] = 0;
    pthread_mutex_unlock(&s->lock);
    if (!done) return 0;
    long lo = s->lo[part], hi = s->hi[part];
    float *t = s->total + lo, *w = s->weights + lo, *ans = s->answer + lo;
    long n = hi - lo;
    if (s->step) {
        if (s->step((int)part)) return fail("the step of part %u failed", part);
        goto send;
    }
    memcpy(t, s->grads[0] + lo, (size_t)n * sizeof(float));
    for (int r = 1; r < s->world; r++) {
        const float *g = s->grads[r] + lo;
        for (long i = 0; i < n; i++) t[i] += g[i];
    }
    const float lr = s->lr;
    for (long i = 0; i < n; i++) w[i] -= lr * t[i];
    memcpy(ans, w, (size_t)n * sizeof(float));
send:
    for (int r = 0; r < s->world; r++) {
        pthread_mutex_lock(&s->sending[r]);
        int rc = send_part(s->fds[r], part, ans, (size_t)n * sizeof(float));
        pthread_mutex_unlock(&s->sending[r]);
        if (rc) return rc;
    }
    return 0;
}

static void *serve_worker(void *p) {
    serve_arg_t *arg = p;
    server_t *s = arg->s;
    int fd = s->fds[arg->rank];
    float *mine = s->grads[arg->rank];
    for (long k = 0; k < s->rounds * s->parts && !s->failed; k++) {
        uint32_t part;
        if (read_full(fd, &part, sizeof part)) goto failed;
        part = ntohl(part);
        if (part >= (uint32_t)s->parts) {
            fail("worker %d sent part %u of %d", arg->rank, part, s->parts);
            goto failed;
        }
        long lo = s->lo[part], n = s->hi[part] - lo;
        if (read_full(fd, mine + lo, (size_t)n * sizeof(float))) goto failed;
        if (!all_finite(mine + lo, n)) {
            fail("part %u of worker %d holds an inf or nan", part, arg->rank);
            goto failed;
        }
        if (arrived(s, part)) goto failed;
    }
    arg->rc = s->failed ? -1 : 0;
    return NULL;
failed:
    s->failed = 1;
    for (int r = 0; r < s->world; r++) shutdown(s->fds[r], SHUT_RDWR); /* the other threads' reads end */
    arg->rc = -1;
    return NULL;
}

int rps_serve(int world, const int *fds, float *weights, float *answer, float *total, float *const *grads,
              int parts, const long *lo, const long *hi, long rounds, float lr, int timeout_ms,
              int (*step)(int part)) {
    rps_error[0] = 0;
    server_t s = {.world = world, .parts = parts, .rounds = rounds, .fds = fds, .weights = weights,
                  .answer = answer, .total = total, .grads = grads, .lo = lo, .hi = hi, .lr = lr,
                  .step = step};
    s.counts = calloc((size_t)parts, sizeof(int));
    s.sending = calloc((size_t)world, sizeof(pthread_mutex_t));
    pthread_t *threads = calloc((size_t)world, sizeof(pthread_t));
    serve_arg_t *args = calloc((size_t)world, sizeof(serve_arg_t));
    int rc = 0, started = 0;
    if (!s.counts || !s.sending || !threads || !args) {
        rc = fail("out of memory");
        goto out;
    }
    pthread_mutex_init(&s.lock, NULL);
    for (int r = 0; r < world; r++) {
        pthread_mutex_init(&s.sending[r], NULL);
        if (prepare(fds[r], timeout_ms)) {
            rc = -1;
            goto out;
        }
    }
    for (; started < world; started++) {
        args[started] = (serve_arg_t){&s, started, 0};
        if (pthread_create(&threads[started], NULL, serve_worker, &args[started])) {
            rc = fail("pthread_create failed");
            s.failed = 1;
            for (int r = 0; r < world; r++) shutdown(fds[r], SHUT_RDWR);
            break;
        }
    }
    for (int r = 0; r < started; r++) {
        pthread_join(threads[r], NULL);
        if (args[r].rc) rc = -1;
    }
out:
    free(s.counts);
    free(s.sending);
    free(threads);
    free(args);
    return rc;
}

/* ---- a worker's step ---- */

typedef struct {
    int parts, window, timeout_ms;
    const int *fds;
    float *flat;
    const long *lo, *hi; /* [server * parts + part]: elements of the flat buffer */
    int inflight, left;
    volatile int failed;
    pthread_mutex_t lock;
    pthread_cond_t cv;
} client_t;

typedef struct {
    client_t *c;
    int server;
    int rc;
} read_arg_t;

static void *read_answers(void *p) {
    read_arg_t *arg = p;
    client_t *c = arg->c;
    int fd = c->fds[arg->server];
    for (int k = 0; k < c->parts; k++) {
        uint32_t part;
        if (read_full(fd, &part, sizeof part)) goto failed;
        part = ntohl(part);
        if (part >= (uint32_t)c->parts) {
            fail("server %d answered part %u of %d", arg->server, part, c->parts);
            goto failed;
        }
        long at = (long)arg->server * c->parts + part;
        if (read_full(fd, c->flat + c->lo[at], (size_t)(c->hi[at] - c->lo[at]) * sizeof(float))) goto failed;
        pthread_mutex_lock(&c->lock);
        c->inflight--;
        c->left--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->lock);
    }
    arg->rc = 0;
    return NULL;
failed:
    pthread_mutex_lock(&c->lock);
    c->failed = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->lock);
    arg->rc = -1;
    return NULL;
}

/* One step: ``grad`` (``n`` elements) checked, its parts sent in ``order`` ((server, part) pairs) at most
 * ``window`` unanswered, every answer read into ``flat``. The sockets stay usable for the next step. */
int rps_step(int servers, const int *fds, const float *grad, float *flat, long n, int parts, const long *lo,
             const long *hi, const int *order, int window, int timeout_ms) {
    rps_error[0] = 0;
    if (!all_finite(grad, n)) return fail("the gradient holds an inf or nan");
    client_t c = {.parts = parts, .window = window, .timeout_ms = timeout_ms, .fds = fds, .flat = flat, .lo = lo,
                  .hi = hi, .left = servers * parts};
    pthread_mutex_init(&c.lock, NULL);
    cond_init(&c.cv);
    pthread_t threads[64];
    read_arg_t args[64];
    if (servers > 64) return fail("%d servers, at most 64", servers);
    int rc = 0, started = 0;
    for (int j = 0; j < servers; j++)
        if (prepare(fds[j], timeout_ms)) return -1;
    for (; started < servers; started++) {
        args[started] = (read_arg_t){&c, started, 0};
        if (pthread_create(&threads[started], NULL, read_answers, &args[started])) {
            rc = fail("pthread_create failed");
            break;
        }
    }
    struct timespec deadline;
    for (int k = 0; rc == 0 && k < servers * parts; k++) {
        int j = order[2 * k], i = order[2 * k + 1];
        deadline_in(&deadline, timeout_ms);
        pthread_mutex_lock(&c.lock);
        while (c.inflight >= window && !c.failed)
            if (pthread_cond_timedwait(&c.cv, &c.lock, &deadline) == ETIMEDOUT) {
                rc = fail("no answer within %d ms", timeout_ms);
                break;
            }
        if (c.failed) rc = -1;
        if (rc == 0) c.inflight++;
        pthread_mutex_unlock(&c.lock);
        if (rc == 0) {
            long at = (long)j * parts + i;
            rc = send_part(fds[j], (uint32_t)i, grad + lo[at], (size_t)(hi[at] - lo[at]) * sizeof(float));
        }
    }
    if (rc) /* the readers wait on answers that will not come */
        for (int j = 0; j < servers; j++) shutdown(fds[j], SHUT_RDWR);
    for (int j = 0; j < started; j++) {
        pthread_join(threads[j], NULL);
        if (args[j].rc) rc = -1;
    }
    pthread_cond_destroy(&c.cv);
    pthread_mutex_destroy(&c.lock);
    return rc;
}
