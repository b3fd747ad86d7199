#include "cluster_config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muster::launcher {
namespace {

bool is_env_name(std::string_view n) {
  if (n.empty() || absl::ascii_isdigit(static_cast<unsigned char>(n[0]))) return false;
  for (char ch : n) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_') return false;
  }
  return true;
}

}  // namespace

bool driver_sets_flag(std::string_view name) {
  static constexpr std::string_view kNames[] = {
      // the cluster's own
      "hosts", "hostfile", "include", "exclude", "ssh_args", "remote_launch", "env",
      // the driver's own server's (its agents do not host)
      "tls_cert", "tls_key", "tls_ca",
      // set per host by the driver
      "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
      "local_addr", "standalone"};
  for (std::string_view n : kNames) {
    if (n == name) return true;
  }
  return false;
}

absl::StatusOr<std::vector<std::string>> split_shell_words(const std::string& text) {
  std::vector<std::string> out;
  std::string word;
  bool in_word = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\'' || ch == '"') {
      // '...' takes everything literally; "..." lets \ escape the next character.
      std::size_t j = i + 1;
      for (; j < text.size() && text[j] != ch; ++j) {
        if (ch == '"' && text[j] == '\\' && j + 1 < text.size()) ++j;
        word += text[j];
      }
      if (j == text.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--ssh_args: unclosed ", ch == '\'' ? "'" : "\"", " in '", text, "'"));
      }
      i = j;
      in_word = true;
    } else if (ch == '\\' && i + 1 < text.size()) {
      word += text[++i];
      in_word = true;
    } else if (ch == ' ' || ch == '\t' || ch == '\n') {
      if (in_word) out.push_back(std::move(word));
      word.clear();
      in_word = false;
    } else {
      word += ch;
      in_word = true;
    }
  }
  if (in_word) out.push_back(std::move(word));
  return out;
}

absl::Status resolve_cluster(LaunchConfig& c, const std::function<bool(std::string_view)>& given) {
  ClusterOptions& k = c.cluster;
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!k.hosts_text.empty() && !k.hostfile.empty()) {
    return bad("give --hosts or --hostfile, not both");
  }
  absl::StatusOr<std::vector<HostSlots>> listed;
  if (!k.hostfile.empty()) {
    std::ifstream in(k.hostfile);
    if (!in) return bad("--hostfile ", k.hostfile, ": cannot read it (", std::strerror(errno), ")");
    std::stringstream text;
    text << in.rdbuf();
    listed = parse_hostfile(text.str(), k.hostfile);
  } else {
    listed = parse_host_list(k.hosts_text);
    if (!listed.ok()) {
      return absl::Status(listed.status().code(),
                          absl::StrCat("--hosts: ", listed.status().message()));
    }
  }
  if (!listed.ok()) return listed.status();
  auto selected = select_hosts(std::move(*listed), k.include, k.exclude);
  if (!selected.ok()) return selected.status();
  k.hosts = std::move(*selected);
  if (k.hosts.empty()) return bad("--include/--exclude left no host to run on");
  const int n = static_cast<int>(k.hosts.size());

  if (given("standalone")) return bad("--standalone runs one node; --hosts starts one per host");
  if (given("node_rank")) {
    return bad("--node_rank: with --hosts the rendezvous gives each host its rank");
  }
  if (given("local_addr")) {
    return bad("--local_addr names one host; with --hosts each agent is given its host's name");
  }
  if (given("rdzv_backend") && c.rdzv_backend != "c10d") {
    return bad("--rdzv_backend=", c.rdzv_backend,
               ": --hosts forms the job with the c10d rendezvous (drop the flag)");
  }
  if (!given("nnodes")) {
    c.min_nodes = c.max_nodes = n;
  } else if (c.min_nodes > n || c.max_nodes > n) {
    return bad("--nnodes=", c.min_nodes == c.max_nodes ? absl::StrCat(c.max_nodes)
                                                        : absl::StrCat(c.min_nodes, ":", c.max_nodes),
               ": only ", n, " host", n == 1 ? "" : "s", " given");
  } else if (c.min_nodes == c.max_nodes && c.max_nodes < n) {
    return bad("--nnodes=", c.max_nodes, " with ", n, " hosts: give --nnodes=", c.max_nodes, ":",
               n, " to let the job go on with fewer hosts, or list ", c.max_nodes);
  }
  c.rdzv_backend = "c10d";
  if (!c.rdzv_endpoint.empty()) {
    auto eps = parse_endpoints(c.rdzv_endpoint, kDefaultRdzvPort);
    if (!eps.ok()) return eps.status();
    if (eps->front().port == 0) return bad("--rdzv_endpoint: port 0 cannot be found by other hosts");
    c.endpoint = eps->front();
    c.more_endpoints.assign(eps->begin() + 1, eps->end());
  }
  if (!given("rdzv_id")) c.rdzv_id.clear();  // the driver makes one per command
  auto words = split_shell_words(k.ssh_args_text);
  if (!words.ok()) return words.status();
  k.ssh_args = std::move(*words);
  for (absl::string_view item : absl::StrSplit(k.env_text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const absl::string_view item_name = item.substr(0, item.find('='));
    const std::string_view name(item_name.data(), item_name.size());
    if (!is_env_name(name)) return bad("--env: '", item, "' is not NAME or NAME=VALUE");
    k.env.emplace_back(item);
  }
  c.mode = RdzvMode::kC10d;
  return absl::OkStatus();
}

}  // namespace muster::launcher
