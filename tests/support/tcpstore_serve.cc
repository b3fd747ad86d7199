// One TCPStore-protocol store in a process of its own, for tests and benchmarks that need it
// outside their own process (10,000 connections: two processes' worth of file descriptors;
// its RSS alone). Prints "port N" once listening, serves until SIGTERM or SIGINT.
//   tcpstore_serve [--max_connections N] [--host ADDR]
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "muster/rendezvous/tcpstore_server.h"

int main(int argc, char** argv) {
  muster::rendezvous::TcpStoreOptions o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--max_connections") {
      o.max_connections = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--host") {
      o.host = argv[i + 1];
    } else {
      std::fprintf(stderr, "tcpstore_serve: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // the server's thread inherits the mask
  auto server = muster::rendezvous::TcpStoreServer::start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "tcpstore_serve: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  std::printf("port %d\n", (*server)->port());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  return 0;
}
