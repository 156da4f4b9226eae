# shared by the .ci lanes: find_py310 -> $PY310 (pyenv's 3.10.13 or python3.10)
find_py310() {
    PY310=""
    local c
    for c in "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.10.13/bin/python" \
             "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.10.13/bin/python")" \
             "$(command -v python3.10 || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then PY310=$c; return 0; fi
    done
    echo "no Python 3.10 found (pyenv's 3.10.13 or python3.10)" >&2
    return 1
}
# pip without the noise of this machine's absent find-links folders
pipq() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
