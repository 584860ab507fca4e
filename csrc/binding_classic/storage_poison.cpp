// te_fuser._storage_poison: the one file of te_fuser on torch's classic (unstable) C++ API.
//
// release_storage() frees a storage that views may still point at. Torch's CPU read kernels
// do not check a storage's size, so a read through such a view would dereference a null data
// pointer. StorageImpl can instead be told to throw on every data-pointer access, reads
// included; that switch is not in the stable ABI (nor bound in CPU builds of torch), hence
// this separate module. It is loaded only by release_storage, which falls back to a weaker
// guard if it does not load (e.g. against another torch version).
#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace {

void poison_storage(const at::Tensor& tensor, std::string message) {
  TORCH_CHECK(tensor.has_storage(), "poison_storage: tensor has no storage");
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->nbytes() == 0, "poison_storage: only a released (0-byte) storage may be poisoned");
  storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("poison_storage(Tensor(a!) tensor, str message) -> ()");
}

TORCH_LIBRARY_IMPL(te_fuser, CompositeExplicitAutograd, m) {
  m.impl("poison_storage", &poison_storage);
}

extern "C" PyMODINIT_FUNC PyInit__storage_poison(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_storage_poison",
                               "torch.ops.te_fuser.poison_storage (classic torch API)", -1,
                               nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
