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
# install_ours VENV: the package itself, editable, without dependencies (each lane pins its own)
install_ours() {
    pipq "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    # the build's ckpt_tools.egg-info left in the checkout would stand for the package on PYTHONPATH=$PWD
    # (importlib.metadata finds it first): a stale one hides the vLLM plugin's entry point
    rm -rf ckpt_tools.egg-info
}
# lane_pytest NAME VENV JUNIT_XML|"" TEST...: run the lane's tests and exit with pytest's code (1 if it collected
# none: pytest's 5)
lane_pytest() {
    local name=$1 venv=$2 xml=$3 rc
    shift 3
    local junit=()
    if [ -n "$xml" ]; then junit=(--junitxml "$xml"); fi
    set +e
    PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly "${junit[@]}" "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "lane $name: pytest collected no tests"; exit 1; fi
    exit "$rc"
}
