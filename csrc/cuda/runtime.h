// The C interface between offtensor.cpp and runtime.cu.
//
// runtime.cu is compiled by nvcc without torch headers and offtensor.cpp by the host compiler without
// CUDA headers, so this file is the only thing both see: plain C types, CUDA handles passed as void*,
// and cudaError_t values passed as int. Functions return 0 or a positive count/ticket on success and
// a negative cudaError_t on failure; ot_cuda_error_string turns the (positive) code into text.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Number of usable GPUs. Any error (no driver, driver too old, no device) reads as 0.
int ot_cuda_device_count(void);

// Page-lock [ptr, ptr + nbytes) for the CUDA driver / undo it. Return 0 or -cudaError_t; undoing
// after the runtime has unloaded at exit counts as success.
int ot_cuda_host_register(void* ptr, size_t nbytes);
int ot_cuda_host_unregister(void* ptr);

// Enqueue a copy of nbytes from src to dst (any direction) on device's dedicated copy stream, after
// all work already enqueued on wait_stream (a cudaStream_t of that device; NULL is its legacy
// default stream). Returns a ticket > 0 that completes after the copy, or -cudaError_t.
int64_t ot_cuda_copy_async(int device, void* dst, const void* src, size_t nbytes, void* wait_stream);

// 1 when the copy for ticket has finished, 0 while it runs, -cudaError_t on failure.
int ot_cuda_query(int64_t ticket);

// Make stream (a cudaStream_t, NULL for the legacy default stream) wait for the copy without
// blocking the host. 0 or -cudaError_t.
int ot_cuda_stream_wait(int64_t ticket, void* stream);

// Block the calling thread until the copy has finished. 0 or -cudaError_t.
int ot_cuda_sync(int64_t ticket);

const char* ot_cuda_error_string(int code);

// The expert pool's fetch: on `stream`, dst[dest[e]] = src[e] (rows of `row_bytes`) for every
// e < rows with 0 <= dest[e] < slots, read from pinned host memory `src` through its device
// address; other rows copy nothing. `dest` is device memory. Returns 0 or a negative error code.
int ot_cuda_masked_row_gather(int device, void* dst, const void* src, const int64_t* dest, int64_t rows,
                              int64_t slots, size_t row_bytes, void* stream);

// The device address of pinned host memory `host` (cudaHostGetDevicePointer), in *device_ptr: what a
// kernel reads it through (UVA). Returns 0 or a negative error code.
int ot_cuda_host_device_pointer(const void* host, void** device_ptr);

#ifdef __cplusplus
}
#endif
