// The floor for launch's start-up (bench/run startup_floor): what spawning N programs by hand
// costs, and nothing else. posix_spawn's each of them, then waits for all.
//
//     spawn_floor N PROGRAM [ARGS...]
#include <spawn.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

extern char** environ;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fputs("usage: spawn_floor N PROGRAM [ARGS...]\n", stderr);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t pid = 0;
    if (posix_spawn(&pid, argv[2], nullptr, nullptr, argv + 2, environ) != 0) {
      std::perror("spawn_floor: posix_spawn");
      return 1;
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  return failed == 0 ? 0 : 1;
}
