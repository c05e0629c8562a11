/* An empty translation unit for shared libraries built from archives alone
 * (shim/CMakeLists.txt: libmtmd.so, and the libllama.so.0 stub it links). */
typedef int sdq_soname_stub;
