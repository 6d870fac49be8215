/* A second process for the C tests: the test's own executable, started with
 * posix_spawn (fork+exec in one step, safe in a process that already runs
 * the Go runtime) and driven by lines on its stdin and stdout. One child per
 * test process. */
#ifndef KVF_CHILD_H
#define KVF_CHILD_H

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvf_test.h"

extern char **environ;

/* The child: its pid (0 once it is gone) and the two ends of its pipes. */
static struct {
    pid_t pid;
    FILE *to, *from;
} kvft_child;

/* A failing check exits: the child must not outlive us (stopped, it would
 * hold ctest's output pipe open until the test times out). */
static inline void kvft_kill_child(void) {
    if (kvft_child.pid > 0) kill(kvft_child.pid, SIGKILL);
}

/* Starts /proc/self/exe with args (args[0] is argv[0], the list ends with
 * NULL), its stdin and stdout connected to kvft_child.to and .from. */
static inline void kvft_spawn_child(char *const args[]) {
    int in[2], out[2];
    CHECK(pipe(in) == 0 && pipe(out) == 0, "pipe: %s", strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    int rc = posix_spawn(&kvft_child.pid, "/proc/self/exe", &fa, NULL, args, environ);
    CHECK(rc == 0, "posix_spawn: %s", strerror(rc));
    atexit(kvft_kill_child);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    kvft_child.to = fdopen(in[1], "w");
    kvft_child.from = fdopen(out[0], "r");
}

/* Sends sig to the child and waits until the kernel reports it stopped,
 * continued or killed by sig: kill() returns before the child's threads
 * have stopped. */
static inline void kvft_signal_child(int sig) {
    CHECK(kill(kvft_child.pid, sig) == 0, "kill: %s", strerror(errno));
    int status = 0;
    int flags = sig == SIGSTOP ? WUNTRACED : sig == SIGCONT ? WCONTINUED : 0;
    pid_t got = waitpid(kvft_child.pid, &status, flags);
    CHECK(got == kvft_child.pid, "waitpid: %s", strerror(errno));
    if (sig == SIGSTOP)
        CHECK(WIFSTOPPED(status), "child status %#x after SIGSTOP", status);
    else if (sig == SIGCONT)
        CHECK(WIFCONTINUED(status), "child status %#x after SIGCONT", status);
    else {
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == sig, "child status %#x after signal %d", status, sig);
        kvft_child.pid = 0;
    }
}

/* Tells the child QUIT and checks that it exits with status 0. */
static inline void kvft_quit_child(void) {
    fprintf(kvft_child.to, "QUIT\n");
    fflush(kvft_child.to);
    int status = 0;
    CHECK(waitpid(kvft_child.pid, &status, 0) == kvft_child.pid, "waitpid: %s", strerror(errno));
    kvft_child.pid = 0;
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status %#x", status);
}

/* Closes our ends of the child's pipes. */
static inline void kvft_close_child(void) {
    fclose(kvft_child.to);
    fclose(kvft_child.from);
}

#endif
