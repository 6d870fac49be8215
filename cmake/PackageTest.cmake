# One step of the package tests (cmake -P), chosen by MODE:
#   install       install the build tree BIN into STAGE and check the files
#   find_package  configure, build and run tests/cpp against STAGE with CMake
#   pkg_config    compile and run tests/cpp/consumer.cpp with pkg-config flags
cmake_minimum_required(VERSION 3.21)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

string(REGEX MATCH "^[0-9]+" MAJOR "${VERSION}")

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${STAGE}")
  run(${CMAKE_COMMAND} --install "${BIN}" --prefix "${STAGE}")
  foreach(f
      "${LIBDIR}/libkvferry.so.${VERSION}" "${LIBDIR}/libkvferry.so.${MAJOR}" "${LIBDIR}/libkvferry.so"
      "${INCLUDEDIR}/kvferry.h" "${INCLUDEDIR}/kvferry.hpp"
      "${LIBDIR}/cmake/kvferry/kvferryConfig.cmake" "${LIBDIR}/cmake/kvferry/kvferryConfigVersion.cmake"
      "${LIBDIR}/pkgconfig/kvferry.pc")
    if(NOT EXISTS "${STAGE}/${f}")
      message(FATAL_ERROR "not installed: ${f}")
    endif()
  endforeach()
  # The soname links are links, not copies.
  foreach(link "libkvferry.so.${MAJOR}" "libkvferry.so")
    if(NOT IS_SYMLINK "${STAGE}/${LIBDIR}/${link}")
      message(FATAL_ERROR "${LIBDIR}/${link} is not a symbolic link")
    endif()
  endforeach()
  file(GLOB cgo_headers "${STAGE}/${INCLUDEDIR}/lib*.h")
  if(cgo_headers)
    message(FATAL_ERROR "the cgo-generated header was installed: ${cgo_headers}")
  endif()
  message(STATUS "installed into ${STAGE}")

elseif(MODE STREQUAL "find_package")
  set(out "${BIN}/consumer-find-package")
  file(REMOVE_RECURSE "${out}")
  run(${CMAKE_COMMAND} -S "${SRC}/tests/cpp" -B "${out}" -G "${GENERATOR}"
      "-DCMAKE_PREFIX_PATH=${STAGE}" "-DCMAKE_CXX_COMPILER=${CXX}" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
  run(${CMAKE_COMMAND} --build "${out}")
  run("${out}/consumer")

elseif(MODE STREQUAL "pkg_config")
  find_program(PKG_CONFIG pkg-config REQUIRED)
  set(ENV{PKG_CONFIG_PATH} "${STAGE}/${LIBDIR}/pkgconfig")
  set(ENV{PKG_CONFIG_LIBDIR} "${STAGE}/${LIBDIR}/pkgconfig")
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs kvferry OUTPUT_VARIABLE flags
                  OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  execute_process(COMMAND ${PKG_CONFIG} --variable=libdir kvferry OUTPUT_VARIABLE libdir
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  execute_process(COMMAND ${PKG_CONFIG} --modversion kvferry OUTPUT_VARIABLE modversion
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0 OR NOT modversion STREQUAL VERSION)
    message(FATAL_ERROR "pkg-config kvferry: rc ${rc}, version '${modversion}', flags '${flags}'")
  endif()
  message(STATUS "pkg-config --cflags --libs kvferry: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(out "${BIN}/consumer-pkg-config")
  run(${CXX} -std=c++17 -Wall -Wextra -Werror "${SRC}/tests/cpp/consumer.cpp" ${flags}
      "-Wl,-rpath,${libdir}" -o "${out}")
  run("${out}")

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
