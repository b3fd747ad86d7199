// The thread that serves TCPStore-protocol tables (tcpstore_server.h's TcpStoreLoop): their
// sockets, and the relayed connections of agents (relay_service.h). Private to the server side.
#pragma once

#include <thread>

#include <boost/asio.hpp>

namespace muster::rendezvous {

class TcpStoreLoop {
 public:
  TcpStoreLoop() : work_(boost::asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  // Lets the thread finish what is queued (the handlers of closed servers), then joins it.
  ~TcpStoreLoop() {
    work_.reset();
    thread_.join();
  }
  boost::asio::io_context& io() { return io_; }

 private:
  boost::asio::io_context io_{1};
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::thread thread_;
};

}  // namespace muster::rendezvous
