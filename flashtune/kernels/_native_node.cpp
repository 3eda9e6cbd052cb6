// flashtune's eager backward node, and its forward launches, in C++.
//
// A Python autograd node costs its backward the GIL and the interpreter on the autograd
// engine's device thread: at tiny shapes that is most of a training step's host time. This
// node runs on that thread without Python. It saves what the Python wiring saves (q, k, v,
// the prefix sums of a packed batch, O and the LSE), and its backward either
//
//   - runs a *program* of the plan: allocations and launches of Triton kernels that were
//     compiled and bound by an earlier Python backward of the same call signature, launched
//     here through the CUDA driver with the argument list Triton's own launcher builds; or
//   - calls the plan's Python backward (``Plan.backward``), holding the GIL: the first
//     backward of a signature, and every call a program does not serve (other strides of
//     dO, unaligned data, another device, a variant that is not bound).
//
// A program of the Hopper (Gluon) backward also allocates its scratch (the fp32 dQ
// accumulator, the semaphores, the KV-head partials), zeroes parts of it, encodes the TMA
// descriptors of each launch (cuTensorMapEncodeTiled, as Triton's launcher does per call),
// sums the partials, and runs the second half of a split backward on a side stream forked
// from the current one and joined back into it.
//
// The module also runs a plan's bound portable *forward* (``forward``): O and the LSE
// allocated here and the kernel launched as above, without Triton's Python launcher.
//
// No CUDA header is needed: the driver entry points are looked up in libcuda at first use,
// and the current stream comes from c10's device-generic stream API. The same source builds
// on a CPU-only torch, where only the Python backward runs.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// ------------------------------------------------------------------------- the CUDA driver

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUfunction = void*;
using CUstream = void*;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  // cuTensorMapEncodeTiled (CUDA 12+): only programs with tensor descriptors need it.
  CUresult (*encode_tiled)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                           const unsigned*, const unsigned*, int, int, int, int) = nullptr;
  bool ok = false;
};

template <typename F>
void lookup(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
}

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return d;
    lookup(lib, "cuLaunchKernel", &d.launch);
    lookup(lib, "cuCtxGetCurrent", &d.ctx_get_current);
    lookup(lib, "cuCtxSetCurrent", &d.ctx_set_current);
    lookup(lib, "cuDeviceGet", &d.device_get);
    lookup(lib, "cuDevicePrimaryCtxRetain", &d.primary_ctx_retain);
    lookup(lib, "cuGetErrorString", &d.error_string);
    lookup(lib, "cuTensorMapEncodeTiled", &d.encode_tiled);
    d.ok = d.launch && d.ctx_get_current && d.ctx_set_current && d.device_get &&
           d.primary_ctx_retain && d.error_string;
    return d;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  if (driver().error_string != nullptr) driver().error_string(r, &msg);
  throw std::runtime_error(std::string("flashtune native backward: ") + what + " failed: " +
                           (msg != nullptr ? msg : "CUDA error " + std::to_string(r)));
}

// Triton's launcher makes the device's primary context current when none is; so do we (the
// engine's device threads normally have it current already).
void ensure_context(int device) {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  check(d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(d.ctx_set_current(ctx), "cuCtxSetCurrent");
}

// ------------------------------------------------------------------------- programs

// The tensors a launch may point into, by slot: the call's, then the program's buffers.
enum Slot : int { Q, K, V, O, DO, LSE, DELTA, DQ, DK, DV, CU_Q, CU_K, N_SLOTS };
constexpr int MAX_BUFFERS = 16;
constexpr int MAX_PARAMS = 254;  // a kernel's parameters, Triton's two scratch pointers aside
constexpr int MAX_MAPS = 16;     // tensor descriptors per launch

struct Param {
  int slot;        // a tensor's data pointer plus ``bits`` bytes (>= 0), an immediate (-1),
                   // or the tensor descriptor ``bits`` of the kernel's maps (-2)
  uint64_t bits;   // the immediate's bytes, little end first; a pointer's byte offset
  int size;        // the immediate's size in bytes (1, 2, 4 or 8)
};

// One tensor descriptor, encoded per launch over a slot's data (plus a byte offset), with
// the arguments Triton's launcher gives cuTensorMapEncodeTiled: dims, byte strides and
// box innermost first.
struct TensorMap {
  int slot;
  uint64_t offset;
  int elem_type, rank, swizzle, fill;
  uint64_t dims[5], strides[5];
  unsigned box[5];
};

struct alignas(128) EncodedMap {
  uint64_t opaque[16];  // CUtensorMap: 128 bytes, passed to the kernel by value
};

struct Kernel {
  CUfunction function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;  // then Triton's two scratch pointers, both null
  std::vector<TensorMap> maps;
};

// A strided view of a slot's tensor: ``offset`` elements past its data.
struct View {
  int slot;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};

// A buffer allocated per call, on the call's device: float32 (0), int32 (1), or the
// dtype of q (2).
struct Buffer {
  std::vector<int64_t> shape;
  int dtype;
};

// What a program does, in order, on the current stream (0) or the side stream (1).
enum StepKind : int { LAUNCH, ZERO, SUM };
struct Step {
  int kind;
  int stream;
  int kernel;   // LAUNCH: which of the program's kernels
  View a, b;    // ZERO: a = 0; SUM: a = the sum of b over its dimension 2
};

// One backward of one plan: the layouts it was bound for and what it launches. Without
// steps, its kernels run in order on the current stream.
struct Program {
  int device;
  std::vector<int64_t> do_strides, o_strides;
  c10::ScalarType do_dtype;
  bool delta;  // allocate a delta buffer shaped like the LSE
  std::vector<Kernel> kernels;
  std::vector<Buffer> buffers;
  std::vector<Step> steps;
  std::optional<c10::Stream> side;  // the side stream, where a step runs on one
};

std::atomic<int64_t> n_native{0}, n_python{0}, n_forward{0};

// What a plan shares with its nodes: its backward programs, written by Python and read by
// the engine's threads.
struct PlanNative {
  std::mutex mu;
  std::vector<std::shared_ptr<const Program>> programs;

  void add(std::shared_ptr<const Program> p) {
    std::lock_guard<std::mutex> lock(mu);
    programs.push_back(std::move(p));
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    programs.clear();
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return programs.size();
  }
  std::shared_ptr<const Program> find(const at::Tensor& d, const at::Tensor& o) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : programs) {
      if (p->device == d.get_device() && p->do_dtype == d.scalar_type() &&
          d.strides().equals(p->do_strides) && o.strides().equals(p->o_strides)) {
        return p;
      }
    }
    return nullptr;
  }
};

// A Python object whose reference is dropped under the GIL, from whatever thread the last
// owner (a node, freed by the autograd engine) happens to run on.
struct PyRef {
  PyObject* obj;
  explicit PyRef(py::handle h) : obj(h.inc_ref().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (obj != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(obj);
    }
  }
};

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Makes ``device`` the current CUDA device (its primary context current) for a scope, as
// torch's device guard does for an op: the kernel handles belong to that device's context,
// while the calling thread's current device may be another one.
struct DeviceScope {
  c10::impl::VirtualGuardImpl impl{c10::DeviceType::CUDA};
  c10::Device old;
  explicit DeviceScope(const c10::Device& dev) : old(impl.exchangeDevice(dev)) {}
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() { impl.uncheckedSetDevice(old); }
};

void encode(const TensorMap& m, const uint64_t* ptr, EncodedMap* out) {
  static const unsigned element_strides[5] = {1, 1, 1, 1, 1};
  // CU_TENSOR_MAP_INTERLEAVE_NONE (0), CU_TENSOR_MAP_L2_PROMOTION_L2_128B (2): Triton's.
  check(driver().encode_tiled(out, m.elem_type, static_cast<unsigned>(m.rank),
                              reinterpret_cast<void*>(ptr[m.slot] + m.offset), m.dims,
                              m.strides, m.box, element_strides, 0, m.swizzle, 2, m.fill),
        "cuTensorMapEncodeTiled");
}

// Launch ``kern`` on ``stream``, its pointers read from ``ptr`` by slot.
void launch_kernel(const Kernel& kern, CUstream stream, const uint64_t* ptr) {
  if (static_cast<uint64_t>(kern.grid[0]) * kern.grid[1] * kern.grid[2] == 0) return;
  EncodedMap maps[MAX_MAPS];
  for (size_t j = 0; j < kern.maps.size(); ++j) encode(kern.maps[j], ptr, &maps[j]);
  uint64_t values[MAX_PARAMS + 2];
  void* params[MAX_PARAMS + 2];
  const size_t n = kern.params.size();
  for (size_t i = 0; i < n; ++i) {
    const Param& prm = kern.params[i];
    if (prm.slot == -2) {
      params[i] = &maps[prm.bits];
      continue;
    }
    values[i] = prm.slot >= 0 ? ptr[prm.slot] + prm.bits : prm.bits;
    params[i] = &values[i];
  }
  values[n] = values[n + 1] = 0;  // Triton's global and profile scratch pointers: none
  params[n] = &values[n];
  params[n + 1] = &values[n + 1];
  check(driver().launch(kern.function, kern.grid[0], kern.grid[1], kern.grid[2], kern.threads,
                        1, 1, kern.shared, stream, params, nullptr),
        "cuLaunchKernel");
}

// Launch ``kernels`` in order on ``device``'s current stream, their pointers read from
// ``ptr`` by slot.
void launch_all(const Kernel* kernels, size_t n_kernels, int device, const uint64_t* ptr) {
  c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  DeviceScope scope(dev);
  auto stream = static_cast<CUstream>(scope.impl.getStream(dev).native_handle());
  ensure_context(device);
  for (const Kernel* kp = kernels; kp != kernels + n_kernels; ++kp) {
    launch_kernel(*kp, stream, ptr);
  }
}

at::Tensor view_of(const at::Tensor* const* tensors, const View& v) {
  const at::Tensor& t = *tensors[v.slot];
  return t.as_strided(v.sizes, v.strides, t.storage_offset() + v.offset);
}

// Run a program's steps on its device: launches through the driver, zeroing and sums
// through ATen (on the step's stream, made current for it). Where a step runs on the side
// stream, the side stream first waits for the current one's work so far, and the current
// one waits for all of the side stream's at the end (the buffers are the current stream's).
void execute(const Program& p, const at::Tensor* const* tensors, const uint64_t* ptr) {
  c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(p.device));
  DeviceScope scope(dev);
  const c10::Stream cur = scope.impl.getStream(dev);
  ensure_context(p.device);
  if (p.side) {
    c10::Event fork(c10::DeviceType::CUDA);
    fork.record(cur);
    fork.block(*p.side);
  }
  for (const Step& step : p.steps) {
    const c10::Stream s = step.stream == 1 && p.side ? *p.side : cur;
    if (step.kind == LAUNCH) {
      launch_kernel(p.kernels[step.kernel], static_cast<CUstream>(s.native_handle()), ptr);
      continue;
    }
    const c10::Stream old = scope.impl.exchangeStream(s);
    try {
      if (step.kind == ZERO) {
        view_of(tensors, step.a).zero_();
      } else {
        at::Tensor out = view_of(tensors, step.a);
        at::sum_out(out, view_of(tensors, step.b), {2});
      }
    } catch (...) {
      scope.impl.exchangeStream(old);
      throw;
    }
    scope.impl.exchangeStream(old);
  }
  if (p.side) {
    c10::Event join(c10::DeviceType::CUDA);
    join.record(*p.side);
    join.block(cur);
  }
}

// ------------------------------------------------------------------------- the node

struct AttentionBackward : public Node {
  std::shared_ptr<PlanNative> native;
  std::shared_ptr<PyRef> plan;  // its .backward(do, q, k, v, o, lse, *cu) -> (dq, dk, dv)
  SavedVariable q_, k_, v_, o_, lse_;
  std::vector<SavedVariable> cu_;

  std::string name() const override { return "FlashAttentionBackward"; }

  void release_variables() override {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    o_.reset_data();
    lse_.reset_data();
    for (auto& c : cu_) c.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& d = grads[0];
    if (!d.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};  // no gradient reached O
    auto self = getptr();
    at::Tensor q = q_.unpack(self), k = k_.unpack(self), v = v_.unpack(self);
    at::Tensor o = o_.unpack(self), lse = lse_.unpack(self);
    std::vector<at::Tensor> cu;
    for (auto& c : cu_) cu.push_back(c.unpack(self));
    if (auto program = serves(d, q, k, v, o, lse, cu)) {
      return run(*program, d, q, k, v, o, lse, cu);
    }
    return python(d, q, k, v, o, lse, cu);
  }

  std::shared_ptr<const Program> serves(const at::Tensor& d, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& o, const at::Tensor& lse,
                                        const std::vector<at::Tensor>& cu) {
    if (!d.is_cuda() || !lse.is_contiguous() || !driver().ok) return nullptr;
    auto program = native->find(d, o);
    if (!program) return nullptr;
    for (const at::Tensor* t : {&d, &q, &k, &v, &o, &lse}) {
      if (!aligned(*t)) return nullptr;
    }
    for (const auto& c : cu) {
      if (!aligned(c)) return nullptr;
    }
    return program;
  }

  variable_list run(const Program& p, const at::Tensor& d, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                    const at::Tensor& lse, const std::vector<at::Tensor>& cu) {
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    at::Tensor delta = p.delta ? at::empty_like(lse) : lse;
    std::vector<at::Tensor> buffers;
    buffers.reserve(p.buffers.size());
    for (const Buffer& b : p.buffers) {
      auto dtype = b.dtype == 0 ? at::kFloat : b.dtype == 1 ? at::kInt : q.scalar_type();
      buffers.push_back(at::empty(b.shape, q.options().dtype(dtype)));
    }
    uint64_t ptr[N_SLOTS + MAX_BUFFERS] = {};
    const at::Tensor* slots[N_SLOTS + MAX_BUFFERS] = {
        &q, &k, &v, &o, &d, &lse, &delta, &dq, &dk, &dv,
        cu.empty() ? &q : &cu[0], cu.empty() ? &q : &cu[1]};
    for (size_t i = 0; i < buffers.size(); ++i) slots[N_SLOTS + i] = &buffers[i];
    const size_t n_slots = N_SLOTS + buffers.size();
    for (size_t i = 0; i < n_slots; ++i) {
      ptr[i] = reinterpret_cast<uint64_t>(slots[i]->data_ptr());
    }
    if (p.steps.empty()) {
      launch_all(p.kernels.data(), p.kernels.size(), p.device, ptr);
    } else {
      execute(p, slots, ptr);
    }
    n_native.fetch_add(1, std::memory_order_relaxed);
    return {dq, dk, dv};
  }

  variable_list python(const at::Tensor& d, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                       const std::vector<at::Tensor>& cu) {
    py::gil_scoped_acquire gil;
    py::tuple args(6 + cu.size());
    const at::Tensor* ts[6] = {&d, &q, &k, &v, &o, &lse};
    for (size_t i = 0; i < 6; ++i) args[i] = py::cast(*ts[i]);
    for (size_t i = 0; i < cu.size(); ++i) args[6 + i] = py::cast(cu[i]);
    py::object out = py::handle(plan->obj).attr("backward")(*args);
    auto grads = out.cast<std::vector<at::Tensor>>();
    if (grads.size() != 3) throw std::runtime_error("Plan.backward must return (dq, dk, dv)");
    n_python.fetch_add(1, std::memory_order_relaxed);
    return {grads[0], grads[1], grads[2]};
  }
};

// Nodes are held by std::shared_ptr up to some torch release, by c10::intrusive_ptr after.
using NodePtr = decltype(std::declval<Node&>().getptr());
template <typename Ptr>
struct Make;
template <typename T>
struct Make<std::shared_ptr<T>> {
  static std::shared_ptr<AttentionBackward> make() {
    return std::make_shared<AttentionBackward>();
  }
};
template <typename T>
struct Make<c10::intrusive_ptr<T>> {
  static c10::intrusive_ptr<AttentionBackward> make() {
    return c10::make_intrusive<AttentionBackward>();
  }
};

// Make ``o`` the output of a new node whose inputs are q, k and v. Nothing else of the
// forward changes: ``o`` and ``lse`` were computed without autograd, and the LSE stays
// without history (it is not differentiable).
void attach(const std::shared_ptr<PlanNative>& native, py::handle plan, const at::Tensor& o,
            const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
            const at::Tensor& v, const std::vector<at::Tensor>& cu) {
  auto node = Make<NodePtr>::make();
  node->native = native;
  node->plan = std::make_shared<PyRef>(plan);
  node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  node->q_ = SavedVariable(q, false);
  node->k_ = SavedVariable(k, false);
  node->v_ = SavedVariable(v, false);
  node->lse_ = SavedVariable(lse, false);
  for (const auto& c : cu) node->cu_.emplace_back(c, false);
  torch::autograd::set_history(o, NodePtr(node));
  node->o_ = SavedVariable(o, true);
}

// A program from its description (see flashtune/kernels/_native.py): kernels as
// (function, grid, threads, shared, [(slot, bits, size), ...], [tensor map, ...]), a tensor
// map as (slot, byte offset, data type, swizzle, fill, element size, dims, strides, box)
// with dims, strides (in elements) and box outermost first, as Triton's descriptors hold
// them; buffers as (shape, dtype code); steps as (kind, stream, kernel, view, view), a
// view as (slot, offset, sizes, strides).
using MapDescription = std::tuple<int, uint64_t, int, int, int, int, std::vector<uint64_t>,
                                  std::vector<uint64_t>, std::vector<unsigned>>;
using KernelDescriptions =
    std::vector<std::tuple<uint64_t, std::vector<unsigned>, unsigned, unsigned,
                           std::vector<std::tuple<int, uint64_t, int>>,
                           std::vector<MapDescription>>>;
using ViewDescription = std::tuple<int, int64_t, std::vector<int64_t>, std::vector<int64_t>>;
using BufferDescriptions = std::vector<std::pair<std::vector<int64_t>, int>>;
using StepDescriptions = std::vector<std::tuple<int, int, int, ViewDescription, ViewDescription>>;

TensorMap tensor_map(const MapDescription& m, int n_slots) {
  const auto& [slot, offset, elem_type, swizzle, fill, elem_size, dims, strides, box] = m;
  const int rank = static_cast<int>(dims.size());
  if (slot < 0 || slot >= n_slots) throw std::invalid_argument("no such tensor slot");
  if (rank < 1 || rank > 5 || strides.size() != dims.size() || box.size() != dims.size()) {
    throw std::invalid_argument("a tensor map has 1 to 5 dims, as many strides and box sizes");
  }
  if (strides[rank - 1] != 1) throw std::invalid_argument("a tensor map's last stride is 1");
  if (driver().encode_tiled == nullptr) {
    throw std::invalid_argument("this CUDA driver has no cuTensorMapEncodeTiled");
  }
  TensorMap t{slot, offset, elem_type, rank, swizzle, fill, {}, {}, {}};
  for (int i = 0; i < rank; ++i) {  // innermost first, strides in bytes, as Triton encodes
    t.dims[rank - 1 - i] = dims[i];
    t.box[rank - 1 - i] = box[i];
    if (i + 1 < rank) t.strides[rank - 2 - i] = strides[i] * static_cast<uint64_t>(elem_size);
  }
  return t;
}

View view(const ViewDescription& v, int n_slots) {
  const auto& [slot, offset, sizes, strides] = v;
  if (slot < 0 || slot >= n_slots || sizes.size() != strides.size()) {
    throw std::invalid_argument("a view names a slot and as many strides as sizes");
  }
  return View{slot, offset, sizes, strides};
}

std::shared_ptr<const Program> program(const at::Tensor& d, const at::Tensor& o, bool delta,
                                       const KernelDescriptions& kernels,
                                       const BufferDescriptions& buffers = {},
                                       const StepDescriptions& steps = {}, bool side = false) {
  if (!d.is_cuda() || d.get_device() != o.get_device()) {
    throw std::invalid_argument("a program serves CUDA tensors of one device");
  }
  if (buffers.size() > MAX_BUFFERS) throw std::invalid_argument("more than 16 buffers");
  const int n_slots = N_SLOTS + static_cast<int>(buffers.size());
  auto p = std::make_shared<Program>();
  p->device = d.get_device();
  p->do_strides = d.strides().vec();
  p->o_strides = o.strides().vec();
  p->do_dtype = d.scalar_type();
  p->delta = delta;
  for (const auto& [function, grid, threads, shared, params, maps] : kernels) {
    if (grid.size() != 3) throw std::invalid_argument("a grid has three dimensions");
    Kernel kern{reinterpret_cast<CUfunction>(function), {grid[0], grid[1], grid[2]}, threads,
                shared, {}, {}};
    if (params.size() > MAX_PARAMS) throw std::invalid_argument("more than 254 kernel parameters");
    if (maps.size() > MAX_MAPS) throw std::invalid_argument("more than 16 tensor maps");
    for (const auto& m : maps) kern.maps.push_back(tensor_map(m, n_slots));
    for (const auto& [slot, bits, size] : params) {
      if (slot >= n_slots || slot < -2) throw std::invalid_argument("no such tensor slot");
      if (slot == -2 && bits >= maps.size()) throw std::invalid_argument("no such tensor map");
      if (slot == -1 && size != 1 && size != 2 && size != 4 && size != 8) {
        throw std::invalid_argument("an immediate is 1, 2, 4 or 8 bytes");
      }
      kern.params.push_back({slot, bits, size});
    }
    p->kernels.push_back(std::move(kern));
  }
  for (const auto& [shape, dtype] : buffers) {
    if (dtype < 0 || dtype > 2) throw std::invalid_argument("a buffer's dtype code is 0, 1 or 2");
    p->buffers.push_back({shape, dtype});
  }
  for (const auto& [kind, stream, kernel, a, b] : steps) {
    Step step{kind, stream, kernel, {}, {}};
    if (stream != 0 && stream != 1) throw std::invalid_argument("a step's stream is 0 or 1");
    if (kind == LAUNCH) {
      if (kernel < 0 || kernel >= static_cast<int>(p->kernels.size())) {
        throw std::invalid_argument("no such kernel");
      }
    } else if (kind == ZERO || kind == SUM) {
      step.a = view(a, n_slots);
      if (kind == SUM) step.b = view(b, n_slots);
    } else {
      throw std::invalid_argument("a step launches (0), zeroes (1) or sums (2)");
    }
    p->steps.push_back(std::move(step));
  }
  if (side) {
    c10::impl::VirtualGuardImpl impl{c10::DeviceType::CUDA};
    p->side = impl.getStreamFromGlobalPool(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(p->device)), false);
  }
  return p;
}


// ------------------------------------------------------------------------- the forward

// One bound portable forward: O shaped like q, the LSE (lse_shape, fp32) or, for a call
// that drops it, the plan's scratch buffer.
struct Forward {
  int device;
  Kernel kernel;
  std::vector<int64_t> lse_shape;
  at::Tensor scratch;  // undefined: none
};

std::pair<at::Tensor, at::Tensor> forward(const Forward& f, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const std::optional<at::Tensor>& cu_q,
                                          const std::optional<at::Tensor>& cu_k, bool want_lse) {
  if (q.get_device() != f.device) throw std::invalid_argument("a forward program of another device");
  at::Tensor o = at::empty_like(q);
  at::Tensor lse = !want_lse && f.scratch.defined()
                       ? f.scratch
                       : at::empty(f.lse_shape, q.options().dtype(at::kFloat));
  const at::Tensor& cq = cu_q ? *cu_q : q;
  const at::Tensor& ck = cu_k ? *cu_k : q;
  uint64_t ptr[N_SLOTS] = {};
  const at::Tensor* slots[N_SLOTS] = {&q, &k, &v, &o, &q, &lse, &q, &q, &q, &q, &cq, &ck};
  for (int i = 0; i < N_SLOTS; ++i) ptr[i] = reinterpret_cast<uint64_t>(slots[i]->data_ptr());
  launch_all(&f.kernel, 1, f.device, ptr);
  n_forward.fetch_add(1, std::memory_order_relaxed);
  return {o, lse};
}
}  // namespace

PYBIND11_MODULE(flashtune_native, m) {
  m.doc() = "flashtune's eager attention backward node (see _native_node.cpp)";
  py::class_<PlanNative, std::shared_ptr<PlanNative>>(m, "PlanNative")
      .def(py::init<>())
      .def("clear", &PlanNative::clear)
      .def("__len__", &PlanNative::size)
      .def("add", [](PlanNative& self, const at::Tensor& d, const at::Tensor& o, bool delta,
                     const KernelDescriptions& kernels, const BufferDescriptions& buffers,
                     const StepDescriptions& steps, bool side) {
        self.add(program(d, o, delta, kernels, buffers, steps, side));
      }, "serve backwards whose dO and O have the layouts of d and o with these launches "
      "(and buffers and steps)", py::arg("do"), py::arg("o"), py::arg("delta"),
      py::arg("kernels"), py::arg("buffers") = BufferDescriptions{},
      py::arg("steps") = StepDescriptions{}, py::arg("side") = false);
  py::class_<Forward, std::shared_ptr<Forward>>(m, "Forward");
  m.def("forward_program", [](const at::Tensor& q, const KernelDescriptions& kernel,
                              std::vector<int64_t> lse_shape,
                              const std::optional<at::Tensor>& scratch) {
    if (!q.is_cuda() || kernel.size() != 1) throw std::invalid_argument("one CUDA kernel");
    auto prog = program(q, q, false, kernel);
    auto f = std::make_shared<Forward>();
    f->device = q.get_device();
    f->kernel = prog->kernels[0];
    f->lse_shape = std::move(lse_shape);
    if (scratch) f->scratch = *scratch;
    return f;
  }, "a bound portable forward as a program", py::arg("q"), py::arg("kernel"),
        py::arg("lse_shape"), py::arg("scratch"));
  m.def("forward", &forward, "(O, LSE) of a forward program: allocate and launch",
        py::arg("program"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_q"),
        py::arg("cu_k"), py::arg("lse"));
  m.def("attach", &attach, "make o the output of a FlashAttentionBackward node",
        py::arg("native"), py::arg("plan"), py::arg("o"), py::arg("lse"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu"));
  m.def("counts", [] {
    return std::make_pair(n_native.load(), n_python.load());
  }, "(backwards run from a program, backwards run by Python)");
  m.def("forward_count", [] { return n_forward.load(); }, "forwards run from a program");
  m.def("driver_ok", [] { return driver().ok; });
  m.def("tma_ok", [] { return driver().ok && driver().encode_tiled != nullptr; },
        "whether programs with tensor descriptors can be made");
  m.def("slots", [] {
    return std::vector<std::string>{"q", "k", "v", "o", "do", "lse", "delta", "dq", "dk",
                                    "dv", "cu_q", "cu_k"};
  });
}
