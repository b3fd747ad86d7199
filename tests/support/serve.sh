# Sourced by the shell tests: serve_then_stop DIR COMMAND... starts a server (rdzvd) with its
# stdout on a pipe, reads it until the server says it is listening (or 30 s pass, or it exits),
# then stops it with SIGTERM and waits for it by its pid: returns 0 only when it listened and
# then exited 0. Its stderr is in DIR/serve.err, for the caller's message.
serve_then_stop() {
  local dir="$1" line listened=1 fd server
  shift
  rm -f "$dir/serve.fifo"
  mkfifo "$dir/serve.fifo"
  (cd "$dir" && exec "$@" >"$dir/serve.fifo" 2>"$dir/serve.err") &
  server=$!
  exec {fd}<"$dir/serve.fifo"
  while IFS= read -r -t 30 line <&"$fd"; do
    if [[ "$line" == *"listening on"* ]]; then
      listened=0
      break
    fi
  done
  kill -TERM "$server" 2>/dev/null || true
  local rc=0
  wait "$server" || rc=$?
  exec {fd}<&-  # open until the server is gone: its last lines never meet a closed pipe
  rm -f "$dir/serve.fifo"
  [ "$listened" = 0 ] && [ "$rc" = 0 ]
}
