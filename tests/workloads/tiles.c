/* A server for the AMX tests (tests/test_xcomp.py), dumped and restored by real CRIU.
 *
 * At start it asks for the AMX permission, as oneDNN does, then answers one line per
 * connection on a Unix socket, blocked in accept() in between:
 *   tile   run ldtilecfg, tilezero, tilerelease: SIGILL without the permission
 *   perm   the permitted xfeature mask (ARCH_GET_XCOMP_PERM)
 *   spin   the spinner child's iterations and the errors it saw
 *   pids   its PID and the spinner's
 *   sigs   how many SIGRTMIN it handled, and the value the last one carried (sigqueue)
 * With --spinner it forks a child that spins in user space with two copies of one
 * running value in registers: a register that changes under it counts as an error.
 * With --zombie it also holds a child that exited and that it never reaps.
 * With --deny-arch-prctl, once it holds the permission, a seccomp filter makes every
 * later arch_prctl fail with EPERM: a re-grant after a restore is refused.
 * Build: gcc -O2 -o tiles tiles.c
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tilecfg {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static volatile uint64_t *shared; /* [0] spinner iterations, [1] spinner errors */
static volatile sig_atomic_t rt_count, rt_value;

static void on_rt(int sig, siginfo_t *info, void *ctx) {
    (void)sig, (void)ctx;
    rt_count++;
    rt_value = info->si_value.sival_int;
}

__attribute__((target("amx-tile"))) static void tiles(void) {
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = 1;
    cfg.colsb[0] = 4;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
}

static void spin(void) {
    uint64_t a = 1, b = 1;
    for (;;) {
        a = a * 6364136223846793005ULL + 1442695040888963407ULL;
        b = b * 6364136223846793005ULL + 1442695040888963407ULL;
        /* Opaque to the compiler: it must keep both, in registers. */
        __asm__ volatile("" : "+r"(a), "+r"(b));
        if (a != b) {
            shared[1]++;
            b = a;
        }
        shared[0]++;
    }
}

static int deny_arch_prctl(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_arch_prctl, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static int has_flag(int argc, char **argv, const char *flag) {
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], flag) == 0)
            return 1;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [--spinner] [--zombie] [--deny-arch-prctl]\n", argv[0]);
        return 2;
    }
    long granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    int req_errno = granted ? errno : 0;
    if (has_flag(argc, argv, "--deny-arch-prctl") && deny_arch_prctl()) {
        perror("seccomp");
        return 1;
    }
    shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED)
        return 1;
    pid_t child = 0;
    if (has_flag(argc, argv, "--zombie") && fork() == 0)
        _exit(0);
    if (has_flag(argc, argv, "--spinner")) {
        child = fork();
        if (child == 0)
            spin();
    }
    struct sigaction sa = {.sa_sigaction = on_rt, .sa_flags = SA_SIGINFO | SA_RESTART};
    sigaction(SIGRTMIN, &sa, NULL);
    int srv = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, argv[1], sizeof addr.sun_path - 1);
    unlink(argv[1]);
    if (bind(srv, (struct sockaddr *)&addr, sizeof addr) || listen(srv, 8)) {
        perror("bind");
        return 1;
    }
    printf("ready %d %d\n", getpid(), req_errno);
    fflush(stdout);
    uint64_t count = 0;
    for (;;) {
        int c = accept(srv, NULL, NULL);
        if (c < 0)
            continue;
        char line[64] = {0}, out[128];
        if (read(c, line, sizeof line - 1) <= 0) {
            close(c);
            continue;
        }
        if (strncmp(line, "tile", 4) == 0) {
            tiles();
            snprintf(out, sizeof out, "tile %llu\n", (unsigned long long)++count);
        } else if (strncmp(line, "perm", 4) == 0) {
            uint64_t mask = 0;
            syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask);
            snprintf(out, sizeof out, "perm %#llx\n", (unsigned long long)mask);
        } else if (strncmp(line, "spin", 4) == 0) {
            snprintf(out, sizeof out, "spin %llu %llu\n", (unsigned long long)shared[0],
                     (unsigned long long)shared[1]);
        } else if (strncmp(line, "sigs", 4) == 0) {
            snprintf(out, sizeof out, "sigs %d %d\n", (int)rt_count, (int)rt_value);
        } else if (strncmp(line, "pids", 4) == 0) {
            snprintf(out, sizeof out, "pids %d %d\n", getpid(), child);
        } else {
            snprintf(out, sizeof out, "unknown\n");
        }
        printf("%s", out);
        fflush(stdout);
        if (write(c, out, strlen(out)) < 0)
            perror("write");
        close(c);
    }
}
