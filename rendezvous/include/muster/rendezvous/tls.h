// TLS for the rendezvous server's gRPC endpoints (Rendezvous and Store share one port) and
// for its clients: agents, the worker runtime's store client, status calls
// (docs/operations.md, "TLS").
//
// Files are named by the operator (flags, --rdzv_conf keys, MUSTER_TLS_* variables), read
// once by load_server_tls / load_client_tls, and checked there: unreadable, not PEM, an
// encrypted key, a key that is not the certificate's, a certificate of the server that has
// expired or is not valid yet; each error names the setting and the file. The credentials
// are then made from the text in memory: nothing is read again while serving.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class ChannelArguments;
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace muster::rendezvous {

// One PEM file (a certificate chain, a CA bundle or a key) may hold at most this much.
inline constexpr std::size_t kMaxTlsFileBytes = 1 << 20;

// The variables that carry a client's TLS settings: agents read them when --rdzv_conf does
// not name the file, and give them to their workers (with the agent's own values), whose
// store client reads them.
inline constexpr char kTlsCaVar[] = "MUSTER_TLS_CA";
inline constexpr char kTlsCertVar[] = "MUSTER_TLS_CERT";
inline constexpr char kTlsKeyVar[] = "MUSTER_TLS_KEY";
inline constexpr char kTlsServerNameVar[] = "MUSTER_TLS_SERVER_NAME";

// The server's files (rdzvd and the hosting launch: --tls_cert, --tls_key, --tls_ca).
struct ServerTlsFiles {
  std::string cert;       // PEM certificate chain, the server's first
  std::string key;        // its PEM private key (unencrypted)
  std::string client_ca;  // set: mutual TLS, every client must show a certificate it signed
  bool any() const { return !cert.empty() || !key.empty() || !client_ca.empty(); }
};

// What the server listens with; empty (enabled() false): plaintext.
struct ServerTls {
  ServerTlsFiles files;
  std::string cert_pem, key_pem, client_ca_pem;
  bool enabled() const { return !cert_pem.empty(); }
  bool mutual() const { return !client_ca_pem.empty(); }
};

// The files of a client (--rdzv_conf tls_ca=, tls_cert=, tls_key=, tls_server_name=, or the
// MUSTER_TLS_* variables).
struct ClientTlsFiles {
  std::string ca;    // PEM CA certificate(s) the server's certificate must chain to
  std::string cert;  // for mutual TLS: this client's certificate chain ...
  std::string key;   // ... and its private key
  // The name the server's certificate must carry (a DNS or IP subject alternative name);
  // empty: the host of the endpoint as the user gave it (launch fills it in).
  std::string server_name;
  bool any() const { return !ca.empty() || !cert.empty() || !key.empty() || !server_name.empty(); }
};

// What a client connects with; empty (enabled() false): plaintext.
struct ClientTls {
  ClientTlsFiles files;
  std::string ca_pem, cert_pem, key_pem;
  bool enabled() const { return !ca_pem.empty(); }
};

// Reads and checks the files. No file named: a ServerTls that is not enabled. --tls_cert and
// --tls_key go together; --tls_ca needs both.
absl::StatusOr<ServerTls> load_server_tls(const ServerTlsFiles& files);
// The same for a client: nothing named gives plaintext; tls_cert and tls_key go together;
// each of them (and tls_server_name) needs tls_ca.
absl::StatusOr<ClientTls> load_client_tls(const ClientTlsFiles& files);

// The client files named by the MUSTER_TLS_* variables of `env` (empty ones are unset).
ClientTlsFiles client_tls_files_from_env(const std::map<std::string, std::string>& env);
// Those variables for a worker's environment: one per file named (none without TLS).
std::map<std::string, std::string> client_tls_env(const ClientTlsFiles& files);

// gRPC credentials: SSL ones when enabled, else insecure ones.
std::shared_ptr<grpc::ServerCredentials> server_credentials(const ServerTls& tls);
std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const ClientTls& tls);
// Adds what a TLS channel needs to `args`: the name the server's certificate is checked
// against, when one is set (targets are addresses, so this is how a DNS name is checked).
void add_tls_channel_args(const ClientTls& tls, grpc::ChannelArguments& args);

}  // namespace muster::rendezvous
