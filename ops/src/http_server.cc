#include "muster/ops/http_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"

namespace muster::ops {
namespace {

using boost::asio::ip::tcp;

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%' && i + 2 < s.size() && hex_value(s[i + 1]) >= 0 &&
               hex_value(s[i + 2]) >= 0) {
      out += static_cast<char>(hex_value(s[i + 1]) * 16 + hex_value(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

class HttpServer::Impl {
 public:
  explicit Impl(HttpRoutes routes) : routes_(std::move(routes)), acceptor_(io_) {}

  // Before io_: connections still queued in it when it is destroyed count themselves out.
  std::atomic<std::size_t> open_{0};
  boost::asio::io_context io_{1};
  HttpRoutes routes_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  bool stopped_ = false;
  int port_ = 0;

  void accept();
  HttpResponse respond(const std::string& head) const;
};

namespace {

// One connection: read the head (bounded, timed), answer, close.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpServer::Impl& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), timer_(server.io_), buf_(kMaxHttpRequestBytes) {
    ++server_.open_;
  }
  ~Connection() { --server_.open_; }

  void start() {
    timer_.expires_after(kHttpReadTimeout);
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) {
        boost::system::error_code ignored;
        self->socket_.close(ignored);
      }
    });
    boost::asio::async_read_until(
        socket_, buf_, "\r\n\r\n",
        [self = shared_from_this()](const boost::system::error_code& ec, std::size_t n) {
          self->timer_.cancel();
          HttpResponse r;
          if (ec == boost::asio::error::not_found) {  // the buffer's cap: kMaxHttpRequestBytes
            r.status = 431;
            r.body = "request too large\n";
          } else if (ec) {
            return;  // closed, timed out or broken: nobody to answer
          } else {
            std::string head(boost::asio::buffers_begin(self->buf_.data()),
                             boost::asio::buffers_begin(self->buf_.data()) + n);
            r = self->server_.respond(head);
          }
          self->write(r, head_only(self->buf_, n));
        });
  }

 private:
  static bool head_only(const boost::asio::streambuf& buf, std::size_t n) {
    return n >= 5 && std::string(boost::asio::buffers_begin(buf.data()),
                                 boost::asio::buffers_begin(buf.data()) + 5) == "HEAD ";
  }

  void write(const HttpResponse& r, bool head) {
    out_ = absl::StrCat("HTTP/1.1 ", r.status, " ", reason(r.status), "\r\nContent-Type: ",
                        r.content_type, "\r\nContent-Length: ", r.body.size(),
                        "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n");
    if (!head) out_ += r.body;
    boost::asio::async_write(socket_, boost::asio::buffer(out_),
                             [self = shared_from_this()](const boost::system::error_code&,
                                                         std::size_t) {
                               boost::system::error_code ignored;
                               self->socket_.shutdown(tcp::socket::shutdown_both, ignored);
                               self->socket_.close(ignored);
                             });
  }

  HttpServer::Impl& server_;
  tcp::socket socket_;
  boost::asio::steady_timer timer_;
  boost::asio::streambuf buf_;
  std::string out_;
};

}  // namespace

HttpResponse HttpServer::Impl::respond(const std::string& head) const {
  HttpResponse bad{400, "text/plain; charset=utf-8", "bad request\n"};
  const auto line_end = head.find("\r\n");
  const std::string line = head.substr(0, line_end);
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || line.compare(sp2 + 1, 5, "HTTP/") != 0) return bad;
  const std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (method != "GET" && method != "HEAD") {
    return HttpResponse{405, "text/plain; charset=utf-8", "only GET and HEAD\n"};
  }
  HttpRequest req;
  req.method = method;
  const auto q = target.find('?');
  req.path = target.substr(0, q);
  if (q != std::string::npos) req.query = target.substr(q + 1);
  auto it = routes_.find(req.path);
  if (it == routes_.end()) return HttpResponse{404, "text/plain; charset=utf-8", "not found\n"};
  try {
    return it->second(req);
  } catch (const std::exception& e) {
    return HttpResponse{500, "text/plain; charset=utf-8", absl::StrCat("error: ", e.what(), "\n")};
  }
}

void HttpServer::Impl::accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == boost::asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      if (open_.load() >= kMaxHttpConnections) {
        boost::system::error_code ignored;
        socket.close(ignored);  // over the cap: dropped, the client retries
      } else {
        std::make_shared<Connection>(*this, std::move(socket))->start();
      }
    }
    accept();
  });
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::start(const std::string& host, int port,
                                                              HttpRoutes routes) {
  auto impl = std::make_unique<Impl>(std::move(routes));
  const std::string where = absl::StrCat(host, ":", port);
  boost::system::error_code ec;
  const auto addr = boost::asio::ip::make_address(host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("not an IP address: ", host));
  tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  impl->acceptor_.open(ep.protocol(), ec);
  if (!ec) impl->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor_.bind(ep, ec);
  if (!ec) impl->acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", where, ": ", ec.message()));
  }
  impl->port_ = impl->acceptor_.local_endpoint().port();
  impl->accept();
  Impl* raw = impl.get();
  impl->thread_ = std::thread([raw] { raw->io_.run(); });
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return impl_->port_; }

void HttpServer::stop() {
  if (impl_->stopped_) return;
  impl_->stopped_ = true;
  boost::asio::post(impl_->io_, [impl = impl_.get()] {
    boost::system::error_code ignored;
    impl->acceptor_.close(ignored);
  });
  impl_->io_.stop();  // pending connections are dropped with the io_context
  if (impl_->thread_.joinable()) impl_->thread_.join();
}

std::string query_param(const std::string& query, const std::string& name) {
  std::size_t pos = 0;
  while (pos <= query.size()) {
    const auto amp = query.find('&', pos);
    const std::string pair = query.substr(pos, amp == std::string::npos ? std::string::npos : amp - pos);
    const auto eq = pair.find('=');
    if (percent_decode(pair.substr(0, eq)) == name) {
      return eq == std::string::npos ? std::string() : percent_decode(pair.substr(eq + 1));
    }
    if (amp == std::string::npos) break;
    pos = amp + 1;
  }
  return {};
}

}  // namespace muster::ops
