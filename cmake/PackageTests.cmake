# Tests of the installed package: ctest installs the build into a staging
# prefix (fixture kvf_stage), then loads the installed library with dlopen,
# checks the installed files, and builds and runs a C++ consumer
# (tests/cpp) once with find_package(kvferry CONFIG REQUIRED) and once with
# pkg-config. The steps are in cmake/PackageTest.cmake.
set(KVF_STAGE "${CMAKE_CURRENT_BINARY_DIR}/stage")
set(KVF_PKGTEST ${CMAKE_COMMAND}
    "-DBIN=${CMAKE_CURRENT_BINARY_DIR}" "-DSTAGE=${KVF_STAGE}" "-DSRC=${CMAKE_CURRENT_SOURCE_DIR}"
    "-DLIBDIR=${CMAKE_INSTALL_LIBDIR}" "-DINCLUDEDIR=${CMAKE_INSTALL_INCLUDEDIR}"
    "-DVERSION=${PROJECT_VERSION}" "-DCXX=${CMAKE_CXX_COMPILER}" "-DGENERATOR=${CMAKE_GENERATOR}")

add_test(NAME package_install COMMAND ${KVF_PKGTEST} -DMODE=install -P "${CMAKE_CURRENT_LIST_DIR}/PackageTest.cmake")
set_tests_properties(package_install PROPERTIES FIXTURES_SETUP kvf_stage LABELS "package")

add_test(NAME package_dlopen COMMAND test_dlopen "${KVF_STAGE}/${CMAKE_INSTALL_LIBDIR}/libkvferry.so.${PROJECT_VERSION_MAJOR}")
set_tests_properties(package_dlopen PROPERTIES ENVIRONMENT "${KVF_SAN_ENV}")

add_test(NAME package_cpp_find_package COMMAND ${KVF_PKGTEST} -DMODE=find_package -P "${CMAKE_CURRENT_LIST_DIR}/PackageTest.cmake")
add_test(NAME package_cpp_pkg_config COMMAND ${KVF_PKGTEST} -DMODE=pkg_config -P "${CMAKE_CURRENT_LIST_DIR}/PackageTest.cmake")

set_tests_properties(package_dlopen package_cpp_find_package package_cpp_pkg_config PROPERTIES
  FIXTURES_REQUIRED kvf_stage LABELS "package" TIMEOUT 180)
