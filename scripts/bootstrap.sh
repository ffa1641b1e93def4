# Sourced by ./replica and ./spark-submit.sh: makes sure this checkout can run (Python venv with the pinned
# dependencies, Java 17+), then exports ROOT, STATE, VENV and PY. Every failure is one line with the fix.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${REPLICA_STATE_DIR:-$ROOT/.state}"
VENV="$STATE/venv"
PY="$VENV/bin/python"
export REPLICA_STATE_DIR="$STATE"

replica_die() { echo "replica: $*" >&2; exit 2; }

replica_check_java() {
  local java="java"
  [[ -n "${JAVA_HOME:-}" ]] && java="$JAVA_HOME/bin/java"
  command -v "$java" >/dev/null 2>&1 || replica_die "no Java found: install Java 17+ (apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
  local version major
  version=$("$java" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n 1)
  major=${version%%.*}
  [[ "$major" == 1 ]] && major=$(echo "$version" | cut -d. -f2)
  [[ "$major" =~ ^[0-9]+$ && "$major" -ge 17 ]] || replica_die "Java 17 or newer is required, found '${version:-unknown}' ($java): install openjdk-17-jre-headless or set JAVA_HOME"
}

replica_bootstrap() {
  replica_check_java
  local python="${REPLICA_PYTHON:-python3}"
  command -v "$python" >/dev/null 2>&1 || replica_die "python3 not found: install Python 3.11+ (apt-get install python3 python3-venv)"
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || replica_die "Python 3.11+ is required, found $("$python" --version 2>&1): install a newer python3 or set REPLICA_PYTHON"
  mkdir -p "$STATE"
  local stamp="$STATE/venv.stamp" want
  want=$(cat "$ROOT/pyproject.toml" "$ROOT/requirements-peer.txt" | sha256sum | cut -d' ' -f1)
  if [[ ! -x "$PY" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "replica: installing Python dependencies into $VENV (first run takes a minute or two) ..." >&2
    if [[ ! -x "$PY" ]]; then
      "$python" -m venv "$VENV" >"$STATE/pip.log" 2>&1 || replica_die "creating the virtualenv failed (see $STATE/pip.log): install python3-venv (apt-get install python3-venv)"
    fi
    # The benchmark's peer (kafka2delta) goes in without dependency resolution: see requirements-peer.txt.
    { "$PY" -m pip install --upgrade pip && "$PY" -m pip install -e "$ROOT[dev]" \
      && "$PY" -m pip install --no-deps -r "$ROOT/requirements-peer.txt"; } >>"$STATE/pip.log" 2>&1 \
      || replica_die "pip install failed (see $STATE/pip.log): check access to PyPI and retry"
    echo "$want" >"$stamp"
  fi
  export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" PYSPARK_PYTHON="$PY" PYSPARK_DRIVER_PYTHON="$PY"
}
