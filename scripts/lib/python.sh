# Sourced by the scripts that make Python venvs: `require_python_venv NAME` makes sure $PYTHON
# (default python3) exists with its venv module, installing Debian's packages when it can (a
# fresh Debian/Ubuntu machine may lack them), else exits with a message naming the caller.
PYTHON=${PYTHON:-python3}
require_python_venv() {
    if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            apt-get update -qq >&2 && apt-get install -y -qq python3 python3-venv python3-pip >&2
        fi
    fi
    if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c "import ensurepip, venv" 2>/dev/null; then
        echo "$1: $PYTHON with venv is required (Debian: apt-get install python3-venv)" >&2
        exit 1
    fi
}
